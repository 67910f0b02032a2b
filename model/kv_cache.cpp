#include "model/kv_cache.hpp"

#include <algorithm>
#include <cstring>
#include <unordered_map>

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

KvCache::KvCache(int n_layer, const HeadShape& shape, DType dtype, AttnMethod method)
    : n_layer_(n_layer), shape_(shape), dtype_(dtype), method_(method) {
  shape.validate();
  CASCADE_CHECK(n_layer > 0, "KV cache: n_layer must be positive (got ", n_layer, ")");
}

void KvCache::check_seg(int seg) const {
  CASCADE_CHECK(seg >= 0 && seg < int(segs_.size()), "KV cache: segment ", seg, " does not exist");
  CASCADE_CHECK(!segs_[seg].released, "KV cache: segment ", seg, " was released");
}

int KvCache::add_segment(int parent, int64_t start) {
  CASCADE_CHECK(!unified_built_, "KV cache: no new segments after build_unified");
  Segment s;
  if (parent >= 0) {
    check_seg(parent);
    s.parent = parent;
    s.start = start >= 0 ? start : segs_[parent].start + segs_[parent].layers[0].n;
    CASCADE_CHECK(s.start >= segs_[parent].start, "KV cache: a segment cannot start before its parent");
  } else {
    s.start = start >= 0 ? start : 0;
  }
  s.layers.resize(n_layer_);
  segs_.push_back(std::move(s));
  return int(segs_.size()) - 1;
}

int KvCache::parent(int seg) const {
  check_seg(seg);
  return segs_[seg].parent;
}
int64_t KvCache::n_tokens(int seg) const {
  check_seg(seg);
  return segs_[seg].layers[0].n;
}
int64_t KvCache::start(int seg) const {
  check_seg(seg);
  return segs_[seg].start;
}

std::vector<int> KvCache::path(int seg) const {
  std::vector<int> p;
  for (int g = seg; g >= 0; g = segs_[g].parent) {
    check_seg(g);
    p.push_back(g);
  }
  std::reverse(p.begin(), p.end());
  return p;
}

void KvCache::append_raw(Buf& b, const uint8_t* k, const uint8_t* v, int64_t n) {
  const size_t bytes = size_t(n * row_bytes()), at = size_t(b.n * row_bytes());
  b.k.resize(at + bytes);  // std::vector grows geometrically: appends are amortized O(1) per token
  b.v.resize(at + bytes);
  std::memcpy(b.k.data() + at, k, bytes);
  std::memcpy(b.v.data() + at, v, bytes);
  b.n += n;
}

void KvCache::append(Buf& b, const float* k, const float* v, int64_t n) {
  const int64_t m = n * shape_.n_kv_heads * shape_.head_dim;
  const size_t at = size_t(b.n * row_bytes()), bytes = size_t(n * row_bytes());
  b.k.resize(at + bytes);
  b.v.resize(at + bytes);
  dispatch_dtype(dtype_, [&]<class T>() {
    T* kd = reinterpret_cast<T*>(b.k.data() + at);
    T* vd = reinterpret_cast<T*>(b.v.data() + at);
    for (int64_t i = 0; i < m; ++i) {
      kd[i] = T(k[i]);
      vd[i] = T(v[i]);
    }
  });
  b.n += n;
}

KvView KvCache::view(const Buf& b) const {
  KvView kv;
  kv.dtype = dtype_;
  kv.n_tokens = b.n;
  kv.n_kv_heads = shape_.n_kv_heads;
  kv.head_dim = shape_.head_dim;
  kv.k = b.k.data();
  kv.v = b.v.data();
  kv.stride_head = shape_.head_dim;
  kv.stride_token = int64_t(shape_.n_kv_heads) * shape_.head_dim;
  return kv;
}

void KvCache::copy_path(int dst, int leaf) {
  check_seg(dst);
  CASCADE_CHECK(n_tokens(dst) == 0 && segs_[dst].parent < 0, "KV cache: copy_path needs an empty root segment");
  for (int g : path(leaf))
    for (int il = 0; il < n_layer_; ++il) {
      const Buf& src = segs_[g].layers[il];
      append_raw(segs_[dst].layers[il], src.k.data(), src.v.data(), src.n);
    }
}

void KvCache::release(int seg) {
  check_seg(seg);
  for (Buf& b : segs_[seg].layers) {
    b.n = 0;
    std::vector<uint8_t>().swap(b.k);
    std::vector<uint8_t>().swap(b.v);
  }
  segs_[seg].released = true;
}

void KvCache::build_unified(const std::vector<int>& seq_leaf) {
  CASCADE_CHECK(!unified_built_, "KV cache: build_unified called twice");
  n_seq_ = int(seq_leaf.size());
  n_words_ = std::max<int64_t>(1, (n_seq_ + 63) / 64);
  // Which sequences see each segment.
  std::vector<std::vector<int>> seg_seqs(segs_.size());
  for (int s = 0; s < n_seq_; ++s)
    for (int g : path(seq_leaf[s])) seg_seqs[g].push_back(s);
  ubuf_.assign(n_layer_, Buf{});
  for (int g = 0; g < int(segs_.size()); ++g) {
    if (seg_seqs[g].empty() || segs_[g].released) continue;
    const int64_t n = segs_[g].layers[0].n;
    for (int il = 0; il < n_layer_; ++il) {
      const Buf& src = segs_[g].layers[il];
      append_raw(ubuf_[il], src.k.data(), src.v.data(), src.n);
    }
    for (int64_t t = 0; t < n; ++t) {
      key_pos_.push_back(int32_t(segs_[g].start + t));
      const size_t w0 = key_seqs_.size();
      key_seqs_.resize(w0 + n_words_, 0);
      for (int s : seg_seqs[g]) key_seqs_[w0 + s / 64] |= uint64_t(1) << (s % 64);
    }
  }
  for (int g = 0; g < int(segs_.size()); ++g)
    if (!segs_[g].released) release(g);
  unified_built_ = true;
}

void KvCache::begin_step(std::vector<Entry> entries) {
  entries_ = std::move(entries);
  step_rows_ = 0;
  for (const Entry& e : entries_) {
    CASCADE_CHECK(e.n_rows >= 0, "KV cache: negative row count in a step");
    step_rows_ += e.n_rows;
  }
  step_paths_.clear();
  step_segs_.clear();
  row_seq_.clear();
  row_pos_.clear();
  if (unified_built_) {
    for (const Entry& e : entries_) {
      CASCADE_CHECK(e.id >= 0 && e.id < n_seq_, "KV cache: step names sequence ", e.id, " of ", n_seq_);
      for (int64_t i = 0; i < e.n_rows; ++i) {
        row_seq_.push_back(e.id);
        row_pos_.push_back(int32_t(e.pos + i));
        // The step's keys: this token, seen by its own sequence only.
        key_pos_.push_back(int32_t(e.pos + i));
        const size_t w0 = key_seqs_.size();
        key_seqs_.resize(w0 + n_words_, 0);
        key_seqs_[w0 + e.id / 64] |= uint64_t(1) << (e.id % 64);
      }
    }
    return;
  }
  std::unordered_map<int, int> compact;
  step_independent_ = true;
  for (const Entry& e : entries_) {
    check_seg(e.id);
    CASCADE_CHECK(e.pos == segs_[e.id].start + segs_[e.id].layers[0].n, "KV cache: a step appends to segment ",
                  e.id, " at position ", e.pos, " but its next position is ",
                  segs_[e.id].start + segs_[e.id].layers[0].n);
    std::vector<int> p;
    for (int g : path(e.id)) {
      auto [it, added] = compact.try_emplace(g, int(step_segs_.size()));
      if (added) step_segs_.push_back(g);
      p.push_back(it->second);
    }
    step_independent_ = step_independent_ && p.size() == 1;
    step_paths_.push_back(std::move(p));
  }
}

void KvCache::store(int il, const float* k, const float* v) {
  CASCADE_CHECK(il >= 0 && il < n_layer_, "KV cache: layer ", il, " out of range");
  const int64_t per_row = int64_t(shape_.n_kv_heads) * shape_.head_dim;
  if (unified_built_) {
    append(ubuf_[il], k, v, step_rows_);
    return;
  }
  int64_t row = 0;
  for (const Entry& e : entries_) {
    append(segs_[e.id].layers[il], k + row * per_row, v + row * per_row, e.n_rows);
    row += e.n_rows;
  }
}

void KvCache::attend(int il, const float* q, float* o, const cpu::Options& opt) {
  if (unified_built_) {
    cpu::UnifiedBatch b;
    b.kv = view(ubuf_[il]);
    b.key_seqs = key_seqs_.data();
    b.n_words = n_words_;
    b.key_pos = key_pos_.data();
    b.n_rows = step_rows_;
    b.row_seq = row_seq_.data();
    b.row_pos = row_pos_.data();
    cpu::attend_unified(shape_, b, q, o, nullptr, opt);
    return;
  }
  std::vector<KvView> views;
  views.reserve(step_segs_.size());
  for (int g : step_segs_) views.push_back(view(segs_[g].layers[il]));
  std::vector<int64_t> n_query;
  for (const Entry& e : entries_) n_query.push_back(e.n_rows);
  const Plan plan = step_independent_ ? Plan::independent(shape_, std::move(views), n_query)
                                      : Plan::build(shape_, std::move(views), step_paths_, n_query);
  // auto: the cascade tree, regrouped where a shared pass does not pay (auto.hpp). The cost model is given
  // (generate() sets it), or calibrated once here, at the first step where some span is shared (a lone
  // sequence has nothing to choose).
  if (method_ == AttnMethod::auto_ && !step_independent_ && plan.n_sequences() >= 2) {
    if (!cost_) cost_ = calibrate(opt.n_threads, shape_);
    cpu::attend(choose_plan(plan, *cost_), q, o, nullptr, opt);
    return;
  }
  cpu::attend(plan, q, o, nullptr, opt);
}

int64_t KvCache::stored_tokens() const {
  int64_t n = 0;
  for (const Segment& s : segs_) n += s.layers[0].n;
  if (unified_built_) n += ubuf_[0].n;
  return n;
}

size_t KvCache::kv_bytes() const {
  size_t n = 0;
  for (const Segment& s : segs_)
    for (const Buf& b : s.layers) n += size_t(2 * b.n * row_bytes());
  for (const Buf& b : ubuf_) n += size_t(2 * b.n * row_bytes());
  return n;
}

}  // namespace cascade
