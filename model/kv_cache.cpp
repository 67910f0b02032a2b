#include "model/kv_cache.hpp"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "cascade/cpu/calibrate.hpp"
#include "cascade/error.hpp"

namespace cascade {

const char* attn_method_name(AttnMethod m) {
  switch (m) {
    case AttnMethod::cascade: return "cascade";
    case AttnMethod::split: return "split";
    case AttnMethod::unified: return "unified";
    case AttnMethod::auto_: return "auto";
  }
  return "?";
}

AttnMethod parse_attn_method(std::string_view s) {
  if (s == "cascade") return AttnMethod::cascade;
  if (s == "split") return AttnMethod::split;
  if (s == "unified") return AttnMethod::unified;
  if (s == "auto") return AttnMethod::auto_;
  detail::fail("unknown attention method '", s, "' (expected cascade, split, unified or auto)");
}

// --- KvCache ---

KvCache::KvCache(int n_layer, const HeadShape& shape, DType dtype) : n_layer_(n_layer), shape_(shape), dtype_(dtype) {
  shape.validate();
  CASCADE_CHECK(n_layer > 0, "KV cache: n_layer must be positive (got ", n_layer, ")");
  CASCADE_CHECK(dtype != DType::q8_0 || shape.head_dim % kQ8Block == 0, "KV cache: q8_0 K/V needs a head dim that is "
                "a multiple of ", kQ8Block, " (this one's is ", shape.head_dim, ")");
}

// Grows every buffer dst[i] (holding `at` tokens of per_token[i] bytes) by n tokens, copied from src[i] (nullptr: left
// for the caller to fill).
static void grow(std::array<std::vector<uint8_t>*, 4> dst, const std::array<size_t, 4>& per_token, int64_t at,
                 int64_t n, const std::array<const void*, 4>& src) {
  for (size_t i = 0; i < dst.size(); ++i) {
    const size_t bytes = size_t(n) * per_token[i], from = size_t(at) * per_token[i];
    dst[i]->resize(from + bytes);  // std::vector grows geometrically: appends are amortized O(1) per token
    if (bytes && src[i]) std::memcpy(dst[i]->data() + from, src[i], bytes);
  }
}

void KvCache::set_layer_windows(const std::vector<int64_t>& windows) {
  CASCADE_CHECK(windows.empty() || int64_t(windows.size()) == n_layer_, "KV cache: ", windows.size(),
                " layer windows for ", n_layer_, " layers");
  for (int64_t w : windows) CASCADE_CHECK(w >= 0, "KV cache: negative sliding window (", w, ")");
  layer_windows_ = windows;
  if (std::all_of(windows.begin(), windows.end(), [](int64_t w) { return w == 0; })) layer_windows_.clear();
}

void KvCache::append_raw(KvBuffer& b, const KvBuffer& src) const {
  const auto s = planes(src);
  grow(planes(b), plane_bytes(), b.n, src.n, {s[0]->data(), s[1]->data(), s[2]->data(), s[3]->data()});
  b.n += src.n;
}

void KvCache::append_view(KvBuffer& b, const KvView& src) const {
  grow(planes(b), plane_bytes(), b.n, src.n_tokens, {src.k, src.v, src.k_scales, src.v_scales});
  b.n += src.n_tokens;
}

void KvCache::append(KvBuffer& b, const float* k, const float* v, int64_t n) const {
  const int64_t m = n * shape_.n_kv_heads * shape_.head_dim;
  grow(planes(b), plane_bytes(), b.n, n, {nullptr, nullptr, nullptr, nullptr});
  const size_t at = size_t(b.n * row_bytes());
  dispatch_dtype(dtype_, [&]<class T>() {
    if constexpr (std::is_same_v<T, Q8Code>) {
      const size_t s_at = size_t(b.n * scale_row_bytes());
      quantize_q8_0(k, m, reinterpret_cast<int8_t*>(b.k.data() + at), reinterpret_cast<f16*>(b.k_scales.data() + s_at));
      quantize_q8_0(v, m, reinterpret_cast<int8_t*>(b.v.data() + at), reinterpret_cast<f16*>(b.v_scales.data() + s_at));
    } else {
      T* kd = reinterpret_cast<T*>(b.k.data() + at);
      T* vd = reinterpret_cast<T*>(b.v.data() + at);
      for (int64_t i = 0; i < m; ++i) {
        kd[i] = T(k[i]);
        vd[i] = T(v[i]);
      }
    }
  });
  b.n += n;
}

KvView KvCache::view(const KvBuffer& b) const {
  KvView kv;
  kv.dtype = dtype_;
  kv.n_tokens = b.n;
  kv.n_kv_heads = shape_.n_kv_heads;
  kv.head_dim = shape_.head_dim;
  kv.k = b.k.data();
  kv.v = b.v.data();
  if (dtype_ == DType::q8_0) {
    kv.k_scales = b.k_scales.data();
    kv.v_scales = b.v_scales.data();
  }
  kv.stride_head = shape_.head_dim;
  kv.stride_token = int64_t(shape_.n_kv_heads) * shape_.head_dim;
  return kv;
}

int64_t KvCache::count_rows(const std::vector<Entry>& entries) {
  step_rows_ = 0;
  for (const Entry& e : entries) {
    CASCADE_CHECK(e.n_rows >= 0, "KV cache: negative row count in a step");
    step_rows_ += e.n_rows;
  }
  return step_rows_;
}

// --- TreeCache ---

TreeCache::TreeCache(int n_layer, const HeadShape& shape, DType dtype, bool regroup)
    : KvCache(n_layer, shape, dtype), regroup_(regroup) {}

void TreeCache::check_seg(int seg) const {
  CASCADE_CHECK(seg >= 0 && seg < int(segs_.size()), "KV cache: segment ", seg, " does not exist");
  CASCADE_CHECK(segs_[size_t(seg)].live, "KV cache: segment ", seg, " was released");
}

int TreeCache::add_segment(int parent, int64_t start) {
  Segment s;
  s.live = true;
  if (parent >= 0) {
    check_seg(parent);
    const Segment& p = segs_[size_t(parent)];
    s.parent = parent;
    s.start = start >= 0 ? start : p.start + p.layers[0].n;
    CASCADE_CHECK(s.start >= p.start, "KV cache: a segment cannot start before its parent");
  } else {
    s.start = start >= 0 ? start : 0;
  }
  s.layers.resize(size_t(n_layer_));
  in_step_ = false;
  int id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
    segs_[size_t(id)] = std::move(s);
  } else {
    id = int(segs_.size());
    segs_.push_back(std::move(s));
  }
  if (parent >= 0) ++segs_[size_t(parent)].n_children;
  return id;
}

int TreeCache::split(int seg, int64_t n_keep) {
  check_seg(seg);
  const int64_t n = n_tokens(seg);
  CASCADE_CHECK(n_keep > 0 && n_keep < n, "KV cache: cannot split segment ", seg, " of ", n, " tokens after ",
                n_keep);
  const int tail = add_segment(seg, segs_[size_t(seg)].start + n_keep);
  Segment& head = segs_[size_t(seg)];
  Segment& t = segs_[size_t(tail)];
  const std::array<size_t, 4> per_token = plane_bytes();
  for (int il = 0; il < n_layer_; ++il) {
    KvBuffer& from = head.layers[size_t(il)];
    KvBuffer& to = t.layers[size_t(il)];
    const auto src = planes(from), dst = planes(to);
    for (size_t i = 0; i < src.size(); ++i) {
      const size_t keep = size_t(n_keep) * per_token[i];
      dst[i]->assign(src[i]->begin() + ptrdiff_t(keep), src[i]->begin() + ptrdiff_t(size_t(from.n) * per_token[i]));
      src[i]->resize(keep);
      src[i]->shrink_to_fit();  // the head is complete: it keeps no room for the tokens that moved
    }
    to.n = from.n - n_keep;
    from.n = n_keep;
  }
  hand_children(seg, tail);
  return tail;
}

int TreeCache::split_ahead(int seg, int64_t n_keep) {
  check_seg(seg);
  const int64_t n = n_tokens(seg);
  CASCADE_CHECK(n_keep > 0 && n_keep >= n, "KV cache: cannot split segment ", seg, " of ", n,
                " tokens ahead of its tokens after ", n_keep);
  const int tail = add_segment(seg, segs_[size_t(seg)].start + n_keep);
  // The head will hold n_keep tokens: room reserved beyond them is given back.
  const std::array<size_t, 4> per_token = plane_bytes();
  for (KvBuffer& b : segs_[size_t(seg)].layers) {
    const auto xs = planes(b);
    for (size_t i = 0; i < xs.size(); ++i) {
      const size_t keep = size_t(n_keep) * per_token[i];
      if (xs[i]->capacity() <= keep) continue;
      std::vector<uint8_t> y;
      y.reserve(keep);
      y.assign(xs[i]->begin(), xs[i]->end());
      xs[i]->swap(y);
    }
  }
  hand_children(seg, tail);
  return tail;
}

// The tail of a split takes over the head's other children.
void TreeCache::hand_children(int from, int to) {
  for (int c = 0; c < int(segs_.size()); ++c) {
    if (c == to || !segs_[size_t(c)].live || segs_[size_t(c)].parent != from) continue;
    segs_[size_t(c)].parent = to;
    ++segs_[size_t(to)].n_children;
    --segs_[size_t(from)].n_children;
  }
}

int TreeCache::parent(int seg) const {
  check_seg(seg);
  return segs_[size_t(seg)].parent;
}
int TreeCache::n_children(int seg) const {
  check_seg(seg);
  return segs_[size_t(seg)].n_children;
}
int64_t TreeCache::n_tokens(int seg) const {
  check_seg(seg);
  return segs_[size_t(seg)].layers[0].n;
}
int64_t TreeCache::start(int seg) const {
  check_seg(seg);
  return segs_[size_t(seg)].start;
}
KvView TreeCache::view(int seg, int il) const {
  check_seg(seg);
  CASCADE_CHECK(il >= 0 && il < n_layer_, "KV cache: layer ", il, " out of range");
  return KvCache::view(segs_[size_t(seg)].layers[size_t(il)]);
}

std::vector<int> TreeCache::path(int seg) const {
  std::vector<int> p;
  for (int g = seg; g >= 0; g = segs_[size_t(g)].parent) {
    check_seg(g);
    p.push_back(g);
  }
  std::reverse(p.begin(), p.end());
  return p;
}

void TreeCache::copy_path(int dst, int leaf) {
  check_seg(dst);
  CASCADE_CHECK(n_tokens(dst) == 0 && segs_[size_t(dst)].parent < 0, "KV cache: copy_path needs an empty root segment");
  for (int g : path(leaf))
    for (int il = 0; il < n_layer_; ++il)
      append_raw(segs_[size_t(dst)].layers[size_t(il)], segs_[size_t(g)].layers[size_t(il)]);
  in_step_ = false;
}

void TreeCache::release(int seg) {
  check_seg(seg);
  Segment& s = segs_[size_t(seg)];
  CASCADE_CHECK(s.n_children == 0, "KV cache: segment ", seg, " still has ", s.n_children,
                " children (release them first)");
  if (s.parent >= 0) --segs_[size_t(s.parent)].n_children;
  s = Segment{};
  free_ids_.push_back(seg);
  in_step_ = false;
}

void TreeCache::release_paths(const std::vector<int>& leaves) {
  std::vector<int> segs;  // every segment on a path, once
  for (int leaf : leaves)
    for (int g : path(leaf))
      if (std::find(segs.begin(), segs.end(), g) == segs.end()) segs.push_back(g);
  while (!segs.empty()) {
    const size_t before = segs.size();
    std::erase_if(segs, [&](int g) {
      if (n_children(g) > 0) return false;
      release(g);
      return true;
    });
    CASCADE_CHECK(segs.size() < before, "KV cache: segment ", segs.front(), " on a released path has a child off it");
  }
}

void TreeCache::reserve(int seg, int64_t n_tokens) {
  check_seg(seg);
  CASCADE_CHECK(n_tokens >= 0, "KV cache: cannot reserve ", n_tokens, " tokens");
  const std::array<size_t, 4> per_token = plane_bytes();
  for (KvBuffer& b : segs_[size_t(seg)].layers) {
    const auto xs = planes(b);
    for (size_t i = 0; i < xs.size(); ++i) xs[i]->reserve(size_t(n_tokens) * per_token[i]);
  }
}

// The step's tree: the entries' paths over the segments they use (compact ids, in order of first use), each
// segment as long as it will be once the step's rows are stored.
Tree TreeCache::step_tree(const std::vector<Entry>& entries) {
  step_segs_.clear();
  compact_.assign(segs_.size(), -1);
  std::vector<int64_t> len;
  std::vector<std::vector<int>> paths;
  std::vector<int64_t> n_query;
  std::vector<char> named(segs_.size(), 0);
  for (const Entry& e : entries) {
    check_seg(e.id);
    const Segment& s = segs_[size_t(e.id)];
    CASCADE_CHECK(e.pos == s.start + s.layers[0].n, "KV cache: a step appends to segment ", e.id, " at position ",
                  e.pos, " but its next position is ", s.start + s.layers[0].n);
    CASCADE_CHECK(!named[size_t(e.id)]++, "KV cache: a step names segment ", e.id, " twice");
    std::vector<int> p = path(e.id);
    for (int& g : p) {
      int& c = compact_[size_t(g)];
      if (c < 0) {
        c = int(step_segs_.size());
        step_segs_.push_back(g);
        len.push_back(segs_[size_t(g)].layers[0].n);
      }
      g = c;
    }
    len[size_t(p.back())] += e.n_rows;
    paths.push_back(std::move(p));
    n_query.push_back(e.n_rows);
  }
  // A path's segments must be complete: each ends where the next starts.
  for (const Entry& e : entries)
    for (int g = e.id; segs_[size_t(g)].parent >= 0; g = segs_[size_t(g)].parent) {
      const int p = segs_[size_t(g)].parent;
      CASCADE_CHECK(segs_[size_t(p)].start + len[size_t(compact_[size_t(p)])] == segs_[size_t(g)].start,
                    "KV cache: segment ", p, " ends at position ",
                    segs_[size_t(p)].start + len[size_t(compact_[size_t(p)])],
                    " but its child ", g, " starts at ", segs_[size_t(g)].start);
    }
  return Tree::build(shape_, std::move(len), paths, n_query);
}

void TreeCache::begin_step(const std::vector<Entry>& entries) {
  in_step_ = false;
  count_rows(entries);
  entries_ = entries;
  Tree tree = step_tree(entries);
  cpu::Options opt;
  opt.kv_dtype = dtype_;
  if (regroup_) {
    bool shared = false;  // auto has a choice only where a span is below two sequences
    std::vector<char> seen(size_t(tree.n_segments()), 0);
    for (int s = 0; s < tree.n_sequences() && !shared; ++s)
      for (int g : tree.sequence(s).path) shared = shared || seen[size_t(g)]++ > 0;
    if (shared && !cost_) cost_ = calibrate(0, shape_, dtype_);
    if (shared) opt.cost_model = &*cost_;
  }
  plan_opt_ = opt;
  window_plans_.clear();
  plan_ = cpu::plan(std::move(tree), opt);
  in_step_ = true;
}

const Plan& TreeCache::step_plan(int64_t window) {
  if (window == 0) return plan_;
  for (const auto& [w, p] : window_plans_)
    if (w == window) return p;
  // The plan's positions count from each path's root: a window needs them to be the tokens' own.
  for (int g : step_segs_)
    CASCADE_CHECK(segs_[size_t(g)].parent >= 0 || segs_[size_t(g)].start == 0, "KV cache: root segment ", g,
                  " starts at position ", segs_[size_t(g)].start, ", which a sliding window cannot place");
  window_plans_.emplace_back(window, cpu::plan(plan_.tree().with_window(window), plan_opt_));
  return window_plans_.back().second;
}

void TreeCache::store(int il, const float* k, const float* v) {
  CASCADE_CHECK(in_step_, "KV cache: store() outside a step (begin_step first; the tree changed since)");
  CASCADE_CHECK(il >= 0 && il < n_layer_, "KV cache: layer ", il, " out of range");
  const int64_t per_row = int64_t(shape_.n_kv_heads) * shape_.head_dim;
  int64_t row = 0;
  for (const Entry& e : entries_) {
    append(segs_[size_t(e.id)].layers[size_t(il)], k + row * per_row, v + row * per_row, e.n_rows);
    row += e.n_rows;
  }
}

void TreeCache::attend(int il, const float* q, float* o) {
  CASCADE_CHECK(in_step_, "KV cache: attend() outside a step (begin_step first; the tree changed since)");
  CASCADE_CHECK(il >= 0 && il < n_layer_, "KV cache: layer ", il, " out of range");
  const Plan& plan = step_plan(layer_window(il));
  cpu::run(plan, [&](int g) { return KvCache::view(segs_[size_t(step_segs_[size_t(g)])].layers[size_t(il)]); }, q, o);
}

int64_t TreeCache::stored_tokens() const {
  int64_t n = 0;
  for (const Segment& s : segs_)
    if (s.live) n += s.layers[0].n;
  return n;
}

// The bytes a buffer holds in memory, its room beyond its tokens included.
static size_t capacity_bytes(const KvBuffer& b) {
  return b.k.capacity() + b.v.capacity() + b.k_scales.capacity() + b.v_scales.capacity();
}

size_t TreeCache::allocated_bytes() const {
  size_t n = 0;
  for (const Segment& s : segs_)
    for (const KvBuffer& b : s.layers) n += capacity_bytes(b);
  return n;
}

// --- UnifiedCache ---

UnifiedCache::UnifiedCache(int n_layer, const HeadShape& shape, DType dtype, int max_sequences)
    : KvCache(n_layer, shape, dtype), n_seq_(max_sequences) {
  CASCADE_CHECK(max_sequences > 0 && max_sequences <= 64 * 1024,
                "KV cache: a unified buffer holds 1 to 65536 sequences (got ", max_sequences, ")");
  n_words_ = (n_seq_ + 63) / 64;
  live_.assign(size_t(n_seq_), 0);
  for (int s = n_seq_ - 1; s >= 0; --s) free_ids_.push_back(s);
  buf_.assign(size_t(n_layer_), KvBuffer{});
}

std::vector<int> UnifiedCache::add_sequences(const TreeCache& tree, const std::vector<int>& seq_leaf) {
  const size_t n = seq_leaf.size();
  CASCADE_CHECK(n > 0 && n <= free_ids_.size(), "KV cache: ", n, " new sequences, but ", free_ids_.size(), " of ",
                n_seq_, " ids are free");
  CASCADE_CHECK(tree.n_layer() == n_layer_ && tree.dtype() == dtype_ &&
                    tree.shape().n_kv_heads == shape_.n_kv_heads && tree.shape().head_dim == shape_.head_dim,
                "KV cache: the tree's layout differs from the unified buffer's");
  // The sequences (by index in seq_leaf) that see each segment, segments in order of first sight.
  std::vector<int> order, index_of;
  std::vector<std::vector<size_t>> seqs_of;
  for (size_t i = 0; i < n; ++i)
    for (int g : tree.path(seq_leaf[i])) {
      if (size_t(g) >= index_of.size()) index_of.resize(size_t(g) + 1, -1);
      if (index_of[size_t(g)] < 0) {
        index_of[size_t(g)] = int(order.size());
        order.push_back(g);
        seqs_of.emplace_back();
      }
      seqs_of[size_t(index_of[size_t(g)])].push_back(i);
    }
  std::vector<int> ids(n);
  for (int& id : ids) {
    id = free_ids_.back();
    free_ids_.pop_back();
    live_[size_t(id)] = 1;
  }
  for (size_t j = 0; j < order.size(); ++j) {
    const int g = order[j];
    for (int il = 0; il < n_layer_; ++il) append_view(buf_[size_t(il)], tree.view(g, il));
    for (int64_t t = 0; t < tree.n_tokens(g); ++t) {
      key_pos_.push_back(int32_t(tree.start(g) + t));
      const size_t w0 = key_seqs_.size();
      key_seqs_.resize(w0 + size_t(n_words_), 0);
      for (size_t i : seqs_of[j]) key_seqs_[w0 + size_t(ids[i] / 64)] |= uint64_t(1) << (ids[i] % 64);
    }
  }
  return ids;
}

void UnifiedCache::remove_sequence(int seq) {
  CASCADE_CHECK(live(seq), "KV cache: sequence ", seq, " is not in the unified buffer");
  live_[size_t(seq)] = 0;
  free_ids_.push_back(seq);
  const size_t w = size_t(seq / 64);
  const uint64_t bit = uint64_t(1) << (seq % 64);
  const int64_t n_keys = int64_t(key_pos_.size());
  for (int64_t t = 0; t < n_keys; ++t) {
    uint64_t* words = key_seqs_.data() + t * n_words_;
    if (!(words[w] & bit)) continue;
    words[w] &= ~bit;
    bool dead = true;
    for (int64_t i = 0; i < n_words_ && dead; ++i) dead = words[i] == 0;
    n_dead_ += dead;
  }
  if (n_dead_ > 0 && 2 * n_dead_ >= n_keys) compact();
}

size_t UnifiedCache::allocated_bytes() const {
  size_t n = 0;
  for (const KvBuffer& b : buf_) n += capacity_bytes(b);
  return n;
}

// Keeps the keys some live sequence sees, in order.
void UnifiedCache::compact() {
  const int64_t n_keys = int64_t(key_pos_.size());
  const std::array<size_t, 4> per_token = plane_bytes();
  int64_t out = 0;
  for (int64_t t = 0; t < n_keys; ++t) {
    const uint64_t* words = key_seqs_.data() + t * n_words_;
    bool seen = false;
    for (int64_t i = 0; i < n_words_ && !seen; ++i) seen = words[i] != 0;
    if (!seen) continue;
    if (out != t) {
      for (KvBuffer& b : buf_) {
        const auto xs = planes(b);
        for (size_t i = 0; i < xs.size(); ++i)
          if (per_token[i] > 0)  // a plane the type does not use (a float type's scales) is empty
            std::memmove(xs[i]->data() + size_t(out) * per_token[i], xs[i]->data() + size_t(t) * per_token[i],
                         per_token[i]);
      }
      std::copy_n(words, n_words_, key_seqs_.data() + out * n_words_);
      key_pos_[size_t(out)] = key_pos_[size_t(t)];
    }
    ++out;
  }
  for (KvBuffer& b : buf_) {
    b.n = out;
    const auto xs = planes(b);
    for (size_t i = 0; i < xs.size(); ++i) {
      xs[i]->resize(size_t(out) * per_token[i]);
      xs[i]->shrink_to_fit();
    }
  }
  key_seqs_.resize(size_t(out * n_words_));
  key_pos_.resize(size_t(out));
  n_dead_ = 0;
}

void UnifiedCache::begin_step(const std::vector<Entry>& entries) {
  count_rows(entries);
  row_seq_.clear();
  row_pos_.clear();
  for (const Entry& e : entries) {
    CASCADE_CHECK(live(e.id), "KV cache: step names sequence ", e.id, " of ", n_seq_, ", which is not live");
    for (int64_t i = 0; i < e.n_rows; ++i) {
      row_seq_.push_back(e.id);
      row_pos_.push_back(int32_t(e.pos + i));
      // The step's keys: this token, seen by its own sequence only.
      key_pos_.push_back(int32_t(e.pos + i));
      const size_t w0 = key_seqs_.size();
      key_seqs_.resize(w0 + size_t(n_words_), 0);
      key_seqs_[w0 + size_t(e.id / 64)] |= uint64_t(1) << (e.id % 64);
    }
  }
  plan_ = cpu::plan_unified(shape_, int64_t(key_pos_.size()), step_rows_);
}

void UnifiedCache::store(int il, const float* k, const float* v) {
  CASCADE_CHECK(il >= 0 && il < n_layer_, "KV cache: layer ", il, " out of range");
  append(buf_[size_t(il)], k, v, step_rows_);
}

void UnifiedCache::attend(int il, const float* q, float* o) {
  CASCADE_CHECK(il >= 0 && il < n_layer_, "KV cache: layer ", il, " out of range");
  cpu::UnifiedBatch b;
  b.kv = view(buf_[size_t(il)]);
  b.key_seqs = key_seqs_.data();
  b.n_words = n_words_;
  b.key_pos = key_pos_.data();
  b.n_rows = step_rows_;
  b.row_seq = row_seq_.data();
  b.row_pos = row_pos_.data();
  b.window = layer_window(il);
  cpu::run_unified(plan_, b, q, o);
}

// --- JoinedCache ---

JoinedCache::JoinedCache(KvCache& first, KvCache& second)
    : KvCache(first.n_layer(), first.shape(), first.dtype()), first_(first), second_(second) {
  CASCADE_CHECK(second.n_layer() == first.n_layer() && second.dtype() == first.dtype() &&
                    second.shape().n_q_heads == first.shape().n_q_heads &&
                    second.shape().n_kv_heads == first.shape().n_kv_heads &&
                    second.shape().head_dim == first.shape().head_dim,
                "KV cache: joined caches must have the same layers, head shape and K/V type");
}

void JoinedCache::begin_steps(const std::vector<Entry>& first, const std::vector<Entry>& second) {
  n_first_ = n_second_ = 0;
  step_rows_ = 0;
  if (!first.empty()) {
    first_.begin_step(first);
    n_first_ = first_.step_rows();
  }
  if (!second.empty()) {
    second_.begin_step(second);
    n_second_ = second_.step_rows();
  }
  step_rows_ = n_first_ + n_second_;
}

void JoinedCache::store(int il, const float* k, const float* v) {
  const int64_t off = n_first_ * shape_.n_kv_heads * shape_.head_dim;
  if (n_first_) first_.store(il, k, v);
  if (n_second_) second_.store(il, k + off, v + off);
}

void JoinedCache::set_layer_windows(const std::vector<int64_t>& windows) {
  KvCache::set_layer_windows(windows);
  first_.set_layer_windows(windows);
  second_.set_layer_windows(windows);
}

void JoinedCache::attend(int il, const float* q, float* o) {
  const int64_t off = n_first_ * shape_.n_q_heads * shape_.head_dim;
  if (n_first_) first_.attend(il, q, o);
  if (n_second_) second_.attend(il, q + off, o + off);
}

// --- the methods ---

void KvMethod::set_layer_windows(const std::vector<int64_t>& windows) {
  KvCache::set_layer_windows(windows);
  tree_->set_layer_windows(windows);
  if (step_ != tree_.get()) step_->set_layer_windows(windows);
}

KvMethod::KvMethod(AttnMethod m, std::unique_ptr<TreeCache> tree)
    : KvCache(tree->n_layer(), tree->shape(), tree->dtype()), method_(m), tree_(std::move(tree)), step_(tree_.get()) {}

std::vector<int> KvMethod::start_after_prompts(const std::vector<int>& seq_leaf) {
  std::vector<int> ids = start(seq_leaf, {});
  if (!reads_tree()) tree_->release_paths(seq_leaf);
  return ids;
}

namespace {

// Methods whose sequences are segments of the tree.
class TreeSequences : public KvMethod {
 public:
  TreeSequences(AttnMethod m, std::unique_ptr<TreeCache> tree) : KvMethod(m, std::move(tree)) {}

  void end(int seq) override { tree_->release(seq); }

  void check_sequences(const std::vector<int>& running, std::vector<int>& segments) const override {
    for (int id : running) {
      CASCADE_CHECK(tree_->live(id), "KV cache: running sequence ", id, " is not a live segment");
      segments.push_back(id);
    }
  }

  void begin_steps(const std::vector<Entry>& seqs, const std::vector<Entry>& prefill) override {
    if (prefill.empty()) {
      tree_->begin_step(seqs);
    } else if (seqs.empty()) {
      tree_->begin_step(prefill);
    } else {
      std::vector<Entry> all = seqs;
      all.insert(all.end(), prefill.begin(), prefill.end());
      tree_->begin_step(all);
    }
    step_rows_ = tree_->step_rows();
  }
};

// cascade, auto: a sequence is a segment below its prompt's last one, or that segment itself when it is the
// caller's own and the sequence is alone (its tokens follow the prompt's there).
class CascadeMethod final : public TreeSequences {
 public:
  using TreeSequences::TreeSequences;
  static int64_t copies(int64_t, int64_t) { return 0; }
  bool reads_tree() const override { return true; }

  std::vector<int> start(const std::vector<int>& seq_leaf, const StartOptions& opt) override {
    if (opt.own_leaf && seq_leaf.size() == 1) {
      const int leaf = seq_leaf[0];
      if (opt.n_reserve >= 0) tree_->reserve(leaf, tree_->n_tokens(leaf) + opt.n_reserve);
      borrowed_.push_back(leaf);
      return {leaf};
    }
    std::vector<int> ids;
    for (int leaf : seq_leaf) {
      ids.push_back(tree_->add_segment(leaf));
      if (opt.n_reserve >= 0) tree_->reserve(ids.back(), opt.n_reserve);
    }
    return ids;
  }

  void end(int seq) override {
    const auto it = std::find(borrowed_.begin(), borrowed_.end(), seq);
    if (it == borrowed_.end()) return tree_->release(seq);
    borrowed_.erase(it);  // the caller's leaf: the caller releases it
  }

 private:
  std::vector<int> borrowed_;  // leaves that sequences continue in
};

// split: a sequence is a root segment holding a copy of its whole prompt.
class SplitMethod final : public TreeSequences {
 public:
  using TreeSequences::TreeSequences;
  static int64_t copies(int64_t, int64_t seq_prompt_tokens) { return seq_prompt_tokens; }
  bool reads_tree() const override { return false; }

  std::vector<int> start(const std::vector<int>& seq_leaf, const StartOptions& opt) override {
    std::vector<int> ids;
    for (int leaf : seq_leaf) {
      const int id = tree_->add_segment(-1);
      if (opt.n_reserve >= 0) tree_->reserve(id, tree_->start(leaf) + tree_->n_tokens(leaf) + opt.n_reserve);
      tree_->copy_path(id, leaf);
      ids.push_back(id);
    }
    return ids;
  }
};

// unified: a sequence is an id in a buffer beside the tree; the sequences starting together copy each prompt
// segment into it once. A step's sequence rows attend the buffer, its prefill rows the tree.
class UnifiedMethod final : public KvMethod {
 public:
  UnifiedMethod(AttnMethod m, std::unique_ptr<TreeCache> tree, int max_sequences)
      : KvMethod(m, std::move(tree)),
        buffer_(n_layer_, shape_, dtype_, max_sequences),
        joined_(buffer_, *tree_) {
    step_ = &joined_;
  }
  static int64_t copies(int64_t path_tokens, int64_t) { return path_tokens; }
  bool reads_tree() const override { return false; }

  std::vector<int> start(const std::vector<int>& seq_leaf, const StartOptions&) override {
    return buffer_.add_sequences(*tree_, seq_leaf);
  }
  void end(int seq) override { buffer_.remove_sequence(seq); }

  void check_sequences(const std::vector<int>& running, std::vector<int>&) const override {
    int n_live = 0;
    for (int s = 0; s < buffer_.n_sequences(); ++s) n_live += buffer_.live(s);
    for (int id : running) CASCADE_CHECK(buffer_.live(id), "KV cache: running sequence ", id, " is not in the buffer");
    CASCADE_CHECK(n_live == int(running.size()), "KV cache: ", n_live, " sequences in the unified buffer, ",
                  running.size(), " running");
  }

  void begin_steps(const std::vector<Entry>& seqs, const std::vector<Entry>& prefill) override {
    joined_.begin_steps(seqs, prefill);
    step_rows_ = joined_.step_rows();
  }
  int64_t stored_tokens() const override { return joined_.stored_tokens(); }
  size_t allocated_bytes() const override { return joined_.allocated_bytes(); }

 private:
  UnifiedCache buffer_;
  JoinedCache joined_;  // the buffer's rows, then the tree's
};

}  // namespace

std::unique_ptr<KvMethod> KvMethod::make(AttnMethod m, std::unique_ptr<TreeCache> tree, int max_sequences) {
  CASCADE_CHECK(tree, "KV cache: no tree");
  switch (m) {
    case AttnMethod::cascade:
    case AttnMethod::auto_: return std::make_unique<CascadeMethod>(m, std::move(tree));
    case AttnMethod::split: return std::make_unique<SplitMethod>(m, std::move(tree));
    case AttnMethod::unified: return std::make_unique<UnifiedMethod>(m, std::move(tree), max_sequences);
  }
  detail::fail("KV cache: unknown attention method");
}

std::unique_ptr<KvMethod> KvMethod::make(AttnMethod m, int n_layer, const HeadShape& shape, DType dtype,
                                         int max_sequences, const std::optional<CostModel>& cost_model) {
  std::unique_ptr<TreeCache> tree = make_prefill_cache(m, n_layer, shape, dtype);
  if (cost_model) tree->set_cost_model(*cost_model);
  return make(m, std::move(tree), max_sequences);
}

int64_t KvMethod::copied_tokens(AttnMethod m, int64_t path_tokens, int64_t seq_prompt_tokens) {
  switch (m) {
    case AttnMethod::cascade:
    case AttnMethod::auto_: return CascadeMethod::copies(path_tokens, seq_prompt_tokens);
    case AttnMethod::split: return SplitMethod::copies(path_tokens, seq_prompt_tokens);
    case AttnMethod::unified: return UnifiedMethod::copies(path_tokens, seq_prompt_tokens);
  }
  detail::fail("KV cache: unknown attention method");
}

// The copies exist beside the tree until its prompts are released.
double peak_kv_tokens(AttnMethod m, int64_t tree_tokens, int64_t prompt_tokens, int n_parallel, double gen_tokens) {
  return double(tree_tokens) + double(KvMethod::copied_tokens(m, tree_tokens, n_parallel * prompt_tokens)) +
         gen_tokens;
}

std::unique_ptr<TreeCache> make_prefill_cache(AttnMethod m, int n_layer, const HeadShape& shape, DType dtype) {
  return std::make_unique<TreeCache>(n_layer, shape, dtype, m == AttnMethod::auto_);
}

std::unique_ptr<KvCache> start_sequences(AttnMethod m, std::unique_ptr<TreeCache> prefilled,
                                         const std::vector<int>& seq_leaf, std::vector<int>& seq_id) {
  std::unique_ptr<KvMethod> method = KvMethod::make(m, std::move(prefilled), std::max<int>(1, int(seq_leaf.size())));
  seq_id = method->start_after_prompts(seq_leaf);
  return method;
}

}  // namespace cascade
