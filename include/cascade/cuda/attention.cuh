// Running a plan on a CUDA device: cuda::Workspace.
//
//   const cascade::Plan plan = cascade::cuda::plan_for_device(tree);  // once per step (no K/V)
//   cascade::cuda::Workspace ws(plan);        // uploads the work list, sizes the partial states
//   for each layer:
//     ws.bind(stream, layer_views);           // that layer's device K/V (stream-ordered descriptor upload)
//     ws.attend(stream, q_dev, o_dev, lse_dev);  // launches only
//
// The views point at device (or managed) K/V, f16, bf16 or q8_0 (codes and scales on the device; head dims 64, 96,
// 128, 256), one dtype for the whole plan; each has exactly
// its segment's length in the plan. Their block tables are read on the host (and checked there) and copied
// to the device by bind(), so a table may be host or managed memory. bind() takes the views as a list
// (kv[g]: segment g of plan.tree()) or as a callable (kv(g) -> KvView); calls on one stream are ordered, so
// binding the next layer while the previous one still runs is safe.
//
// attend() is stream-ordered, allocates nothing, and only launches kernels, so it can be captured in a CUDA
// graph (bind() cannot: it copies from the host): the narrow kernel (passes with <= 16 stacked rows per KV
// head: the per-sequence pass, split-KV), the wide kernel (the shared-segment passes: all rows below a
// segment, sequences x GQA group, as the M dimension), then one merge of every output's partial states.
// q, o: (n_rows, n_q_heads, head_dim) f32 device memory, 16-byte aligned; lse: (n_rows, n_q_heads), natural
// log, or nullptr. A row that sees no key gets (0, -inf). The split baseline is a plan too (make_split /
// Tree::independent). The unified baseline (one buffer of all keys, every row scores every key under a
// sequence mask) is Workspace::unified. Errors (bad input, CUDA failures) throw cascade::Error.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "cascade/cpu/attention.hpp"
#include "cascade/cuda/common.cuh"
#include "cascade/cuda/kernel.cuh"
#include "cascade/cuda/schedule.hpp"
#include "cascade/cuda/state.cuh"
#include "cascade/plan.hpp"

namespace cascade::cuda {

struct Options {
  int n_sm = 0;            // multiprocessors to plan for; 0: the current device's
  int blocks_per_sm = 4;   // blocks per multiprocessor the work is split into, about
};

inline ScheduleOptions schedule_options(const Options& opt) {
  ScheduleOptions so;
  so.n_sm = opt.n_sm > 0 ? opt.n_sm : multiprocessor_count();
  so.blocks_per_sm = opt.blocks_per_sm;
  return so;
}

// The plan of a step's tree for the current device (or opt.n_sm multiprocessors).
inline Plan plan_for_device(Tree tree, const Options& opt = {}) { return plan(std::move(tree), schedule_options(opt)); }

class Workspace {
 public:
  Workspace() = default;

  // The cascade path (and the split baseline, a Tree::independent) for a plan made for CUDA.
  explicit Workspace(const Plan& plan) {
    init_shape(plan.shape(), plan.scale());
    n_rows_ = plan.n_rows();
    tree_ = plan.tree();
    source_.resize(size_t(plan.attended().n_segments()));
    for (int k = 0; k < plan.attended().n_segments(); ++k) source_[size_t(k)] = plan.source(k);
    sched_ = lower(plan);
    upload_schedule(nullptr, 0, nullptr, 0);
  }

  // The unified baseline: b.kv is the one device K/V buffer; b's masks (key_seqs, key_pos, row_seq,
  // row_pos) are host arrays, copied into the workspace, and the buffer is bound at once.
  // scale: the softmax scale (0: 1/sqrt(head_dim)).
  static Workspace unified(const HeadShape& shape, const cpu::UnifiedBatch& b, float scale = 0.0f,
                           const Options& opt = {}) {
    shape.validate();
    b.kv.validate("unified KV buffer");
    CASCADE_CHECK(b.kv.n_kv_heads == shape.n_kv_heads && b.kv.head_dim == shape.head_dim, "unified KV buffer has ",
                  b.kv.n_kv_heads, " heads of dim ", b.kv.head_dim, ", the shape says ", shape.n_kv_heads, "/",
                  shape.head_dim);
    CASCADE_CHECK(b.n_rows >= 0 && b.n_words > 0, "unified batch: bad n_rows (", b.n_rows, ") or n_words (",
                  b.n_words, ")");
    CASCADE_CHECK(b.n_rows == 0 || (b.row_seq && b.row_pos), "unified batch: null row data with ", b.n_rows,
                  " rows");
    CASCADE_CHECK(b.kv.n_tokens == 0 || (b.key_seqs && b.key_pos), "unified batch: null key masks with ",
                  b.kv.n_tokens, " keys");
    for (int64_t r = 0; r < b.n_rows; ++r)
      CASCADE_CHECK(b.row_seq[r] >= 0 && b.row_seq[r] < 64 * b.n_words, "unified batch: row ", r, " has sequence ",
                    b.row_seq[r], ", outside the ", 64 * b.n_words, " the key masks hold");
    Workspace ws;
    ws.init_shape(shape, scale != 0.0f ? scale : 1.0f / std::sqrt(float(shape.head_dim)));
    ws.n_rows_ = b.n_rows;
    ws.tree_ = Tree::build(shape, {b.kv.n_tokens}, {}, {}, ws.scale_);
    ws.source_ = {0};
    ws.sched_ = lower_unified(shape, b.kv.n_tokens, b.n_rows, b.row_seq, b.row_pos, schedule_options(opt));
    CASCADE_CHECK(b.window >= 0 && b.window <= std::numeric_limits<int32_t>::max(), "unified batch: sliding window ",
                  b.window, " out of range");
    ws.upload_schedule(b.key_seqs, b.n_words, b.key_pos, b.kv.n_tokens);
    ws.args_.window = int32_t(b.window);
    const KvView kv = b.kv;
    ws.bind(nullptr, [&](int) { return kv; });
    CASCADE_CUDA_CHECK(cudaStreamSynchronize(nullptr), "cuda::Workspace: binding the unified buffer");
    return ws;
  }

  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  Workspace(Workspace&& o) noexcept { *this = std::move(o); }
  Workspace& operator=(Workspace&& o) noexcept {
    if (this != &o) {
      release();
      shape_ = o.shape_, dtype_ = o.dtype_, scale_ = o.scale_, n_rows_ = o.n_rows_, configured_ = o.configured_;
      tree_ = std::move(o.tree_);
      source_ = std::move(o.source_);
      sched_ = std::move(o.sched_);
      mem_ = o.mem_, bytes_ = o.bytes_, kv_mem_ = o.kv_mem_, kv_bytes_ = o.kv_bytes_, bound_ = o.bound_;
      staging_ = std::move(o.staging_);
      args_ = o.args_, out_begin_ = o.out_begin_, out_slots_ = o.out_slots_;
      n_items_[0] = o.n_items_[0], n_items_[1] = o.n_items_[1];
      items_[0] = o.items_[0], items_[1] = o.items_[1];
      o.mem_ = nullptr;
      o.kv_mem_ = nullptr;
    }
    return *this;
  }
  ~Workspace() { release(); }

  // Binds one layer's device K/V: kv(g) (or kv[g]) is segment g of the plan's tree. Checks every view
  // (device memory, lengths, one dtype) and copies the pass descriptors and block tables to the device in
  // stream order. Not capturable in a CUDA graph.
  template <class SegmentKv>
    requires std::is_invocable_r_v<KvView, SegmentKv&, int>
  void bind(cudaStream_t stream, SegmentKv&& kv) {
    std::vector<KvView> given(size_t(tree_.n_segments()));
    DType dt = DType::f16;
    bool have_dt = false;
    for (int g = 0; g < tree_.n_segments(); ++g) {
      KvView& v = given[size_t(g)] = kv(g);
      check_view(v, g);
      if (v.n_tokens == 0) continue;
      CASCADE_CHECK(!have_dt || v.dtype == dt, "cuda::Workspace: segments mix K/V dtypes (", dtype_name(dt),
                    " and ", dtype_name(v.dtype), " in segment ", g, ")");
      dt = v.dtype, have_dt = true;
    }
    init_dtype(dt);
    stage_passes(given);
    if (staging_.size() > size_t(kv_bytes_)) {  // grow the descriptor area; the old one may still be in use
      CASCADE_CUDA_CHECK(cudaStreamSynchronize(stream), "cuda::Workspace: waiting to grow the K/V descriptors");
      if (kv_mem_) cudaFree(kv_mem_);
      kv_mem_ = nullptr;
      kv_bytes_ = int64_t(staging_.size()) * 2;
      CASCADE_CUDA_CHECK(cudaMalloc(&kv_mem_, size_t(kv_bytes_)), "cuda::Workspace: allocating ", kv_bytes_,
                         " bytes of K/V descriptors");
      stage_passes(given);  // the tables' device addresses moved
    }
    if (!staging_.empty())  // a plan without passes (no rows, or no keys) has nothing to upload or point to
      CASCADE_CUDA_CHECK(cudaMemcpyAsync(kv_mem_, staging_.data(), staging_.size(), cudaMemcpyHostToDevice, stream),
                         "cuda::Workspace: uploading the K/V descriptors");
    args_.passes = static_cast<const PassDesc*>(kv_mem_);
    bound_ = true;
  }
  void bind(cudaStream_t stream, std::span<const KvView> kv) {
    CASCADE_CHECK(int64_t(kv.size()) == tree_.n_segments(), "cuda::Workspace: ", kv.size(),
                  " K/V views for a plan of ", tree_.n_segments(), " segments");
    bind(stream, [&](int g) { return kv[size_t(g)]; });
  }

  // Attends q into o (and lse) with the K/V bound last: see the top of this file.
  void attend(cudaStream_t stream, const float* q, float* o, float* lse = nullptr) const {
    if (n_rows_ == 0) return;
    CASCADE_CHECK(bound_, "cuda::Workspace::attend: no K/V bound (bind() first)");
    CASCADE_CHECK(q != nullptr && o != nullptr, "cuda::Workspace::attend: null q or o with ", n_rows_,
                  " query rows");
    CASCADE_CHECK(reinterpret_cast<uintptr_t>(q) % 16 == 0, "cuda::Workspace::attend: q must be 16-byte aligned");
    LaunchArgs args = args_;
    args.q = q;
    const int d = shape_.head_dim;
    for (int cfg : {kNarrow, kWide}) {
      if (n_items_[cfg] == 0) continue;
      args.items = items_[cfg];
      args.n_items = n_items_[cfg];
      launch(args, cfg, stream);
    }
    const int64_t n_out = n_rows_ * shape_.n_q_heads;
    merge_slots(stream, out_begin_, out_slots_, args_.part_o, args_.part_lse, n_out, d, o, lse);
  }

  // bind() then attend(): one layer.
  template <class SegmentKv>
  void run(cudaStream_t stream, SegmentKv&& kv, const float* q, float* o, float* lse = nullptr) {
    bind(stream, std::forward<SegmentKv>(kv));
    attend(stream, q, o, lse);
  }

  const DeviceSchedule& schedule() const { return sched_; }
  int64_t device_bytes() const { return bytes_ + kv_bytes_; }  // everything the workspace holds on the device
  const HeadShape& shape() const { return shape_; }
  int64_t n_rows() const { return n_rows_; }

 private:
  HeadShape shape_;
  DType dtype_ = DType::f16;
  bool configured_ = false;
  float scale_ = 1.0f;
  int64_t n_rows_ = 0;
  Tree tree_;                 // the given segments' lengths (bind checks the views against them)
  std::vector<int> source_;   // per device pass: the given segment it reads
  DeviceSchedule sched_;
  void* mem_ = nullptr;       // the work list, merge lists, masks and partial states
  int64_t bytes_ = 0;
  void* kv_mem_ = nullptr;    // the bound layer's pass descriptors and block tables
  int64_t kv_bytes_ = 0;
  bool bound_ = false;
  std::vector<unsigned char> staging_;
  LaunchArgs args_;
  const WorkItem* items_[2] = {nullptr, nullptr};
  int32_t n_items_[2] = {0, 0};
  const int64_t* out_begin_ = nullptr;
  const int64_t* out_slots_ = nullptr;

  struct Configure {
    template <class T, int D>
    void operator()() const {
      configure_attention<T, D>();
    }
  };

  void release() noexcept {
    if (mem_) cudaFree(mem_);
    if (kv_mem_) cudaFree(kv_mem_);
    mem_ = nullptr;
    kv_mem_ = nullptr;
  }

  void init_shape(const HeadShape& shape, float scale) {
    shape.validate();
    CASCADE_CHECK(head_dim_supported(shape.head_dim), "cuda::Workspace: head_dim ", shape.head_dim,
                  " has no CUDA kernel (64, 80, 96, 128, 256)");
    CASCADE_CHECK(std::isfinite(scale), "cuda::Workspace: softmax scale is not finite");
    shape_ = shape;
    scale_ = scale;
  }

  void init_dtype(DType dt) {
    CASCADE_CHECK(dt == DType::f16 || dt == DType::bf16 || dt == DType::q8_0, "cuda::Workspace: K/V dtype ",
                  dtype_name(dt), " is not supported on CUDA (f16, bf16, q8_0)");
    if (configured_ && dt == dtype_) return;
    dtype_ = dt;
    dispatch(Configure{});
    configured_ = true;
  }

  void check_view(const KvView& kv, int g) const {
    try {
      kv.validate("K/V view");
    } catch (const Error& e) {
      cascade::detail::fail("cuda::Workspace: segment ", g, ": ", e.what());
    }
    CASCADE_CHECK(kv.n_kv_heads == shape_.n_kv_heads && kv.head_dim == shape_.head_dim, "cuda::Workspace: segment ",
                  g, " has ", kv.n_kv_heads, " KV heads of dim ", kv.head_dim, " but the plan has ",
                  shape_.n_kv_heads, " of dim ", shape_.head_dim);
    CASCADE_CHECK(kv.n_tokens == tree_.n_tokens(g), "cuda::Workspace: segment ", g, " has ", kv.n_tokens,
                  " tokens but the plan ", tree_.n_tokens(g));
    if (kv.n_tokens == 0) return;
    CASCADE_CHECK(is_device_pointer(kv.k) && is_device_pointer(kv.v), "segment ", g,
                  ": K/V is not device memory (the CUDA path reads K/V where the KvView points)");
    CASCADE_CHECK(kv.dtype != DType::q8_0 || (is_device_pointer(kv.k_scales) && is_device_pointer(kv.v_scales)),
                  "segment ", g, ": q8_0 scales are not device memory");
    CASCADE_CHECK(!kv.paged() || kv.page_size <= INT32_MAX, "segment ", g, ": page size ", kv.page_size,
                  " does not fit in 32 bits");
  }

  template <class F>
  void dispatch(F&& f) const {
    dispatch_head_dim(shape_.head_dim, [&]<int D>() {
      if (dtype_ == DType::f16) {
        f.template operator()<__half, D>();
      } else if (dtype_ == DType::bf16) {
        f.template operator()<__nv_bfloat16, D>();
      } else if constexpr (D % kQ8Block == 0) {
        f.template operator()<Q8_0, D>();
      } else {  // KvView::validate refuses such a view first
        cascade::detail::fail("cuda::Workspace: q8_0 K/V needs a head dim that is a multiple of ", kQ8Block);
      }
    });
  }

  void launch(const LaunchArgs& args, int cfg, cudaStream_t stream) const {
    dispatch([&]<class T, int D>() { launch_attention<T, D>(args, cfg, stream); });
  }

  // staging_ = the device passes' descriptors, then the block tables they point to (at kv_mem_'s address).
  void stage_passes(const std::vector<KvView>& given) {
    const size_t n_pass = source_.size();
    std::vector<PassDesc> passes(n_pass);
    staging_.assign(n_pass * sizeof(PassDesc), 0);
    const auto* base = static_cast<const unsigned char*>(kv_mem_);
    for (size_t k = 0; k < n_pass; ++k) {
      const KvView& kv = given[size_t(source_[k])];
      PassDesc& p = passes[k];
      p.n_tokens = int32_t(kv.n_tokens);
      p.row_begin = sched_.pass_row_begin[k];
      if (kv.n_tokens == 0) continue;
      p.k = kv.k, p.v = kv.v;
      p.k_scales = kv.k_scales, p.v_scales = kv.v_scales;
      p.stride_token = kv.stride_token, p.stride_head = kv.stride_head;
      // 16-byte copies of 2-byte elements; q8_0: 8-byte loads of codes, whose strides are multiples of 32.
      const bool q8 = kv.dtype == DType::q8_0;
      const int64_t align = q8 ? 8 : 16;
      const auto al = [&](int64_t x) { return q8 || x % 8 == 0; };
      p.vec16 = reinterpret_cast<uintptr_t>(kv.k) % align == 0 && reinterpret_cast<uintptr_t>(kv.v) % align == 0 &&
                al(kv.stride_token) && al(kv.stride_head) && (!kv.paged() || al(kv.stride_page));
      if (kv.paged()) {
        p.page_size = int32_t(kv.page_size);
        p.stride_page = kv.stride_page;
        const size_t n_pages = size_t((kv.n_tokens + kv.page_size - 1) / kv.page_size);
        const size_t off = (staging_.size() + 255) / 256 * 256;
        staging_.resize(off + n_pages * sizeof(int32_t));
        std::memcpy(staging_.data() + off, kv.block_table, n_pages * sizeof(int32_t));
        p.block_table = reinterpret_cast<const int32_t*>(base + off);
      }
    }
    std::memcpy(staging_.data(), passes.data(), n_pass * sizeof(PassDesc));
  }

  // Lays out the static arrays and the partial states in one device allocation and copies the static ones
  // in one transfer.
  void upload_schedule(const uint64_t* key_seqs, int64_t n_words, const int32_t* key_pos, int64_t n_keys) {
    const int d = shape_.head_dim;
    std::vector<unsigned char> blob;
    const auto put = [&](const void* p, size_t n) {
      const size_t off = (blob.size() + 255) / 256 * 256;
      blob.resize(off + n);
      if (n) std::memcpy(blob.data() + off, p, n);
      return off;
    };
    const size_t rows_off = put(sched_.rows.data(), sched_.rows.size() * sizeof(RowDesc));
    size_t items_off[2];
    for (int c = 0; c < 2; ++c) {
      CASCADE_CHECK(sched_.items[c].size() <= size_t(INT32_MAX), "cuda::Workspace: too many work items");
      items_off[c] = put(sched_.items[c].data(), sched_.items[c].size() * sizeof(WorkItem));
      n_items_[c] = int32_t(sched_.items[c].size());
    }
    const size_t begin_off = put(sched_.out_begin.data(), sched_.out_begin.size() * sizeof(int64_t));
    const size_t slots_off = put(sched_.out_slots.data(), sched_.out_slots.size() * sizeof(int64_t));
    size_t seqs_off = 0, pos_off = 0;
    if (key_pos) {
      seqs_off = put(key_seqs, size_t(n_keys * n_words) * sizeof(uint64_t));
      pos_off = put(key_pos, size_t(n_keys) * sizeof(int32_t));
    }
    const size_t static_bytes = (blob.size() + 255) / 256 * 256;
    const size_t o_bytes = size_t(sched_.n_slots) * size_t(d) * sizeof(float);
    const size_t total = static_bytes + o_bytes + size_t(sched_.n_slots) * sizeof(float) + 256;
    CASCADE_CUDA_CHECK(cudaMalloc(&mem_, total), "cuda::Workspace: allocating ", total, " bytes");
    bytes_ = int64_t(total);
    auto* base = static_cast<unsigned char*>(mem_);
    CASCADE_CUDA_CHECK(cudaMemcpy(mem_, blob.data(), blob.size(), cudaMemcpyHostToDevice),
                       "cuda::Workspace: uploading the work list");
    args_ = LaunchArgs{};
    args_.rows = reinterpret_cast<const RowDesc*>(base + rows_off);
    args_.n_q_heads = shape_.n_q_heads;
    args_.group = shape_.group();
    args_.scale_log2 = scale_ * 1.4426950408889634f;
    args_.part_o = reinterpret_cast<float*>(base + static_bytes);
    args_.part_lse = reinterpret_cast<float*>(base + static_bytes + (o_bytes + 255) / 256 * 256);
    if (key_pos) {
      args_.key_seqs = reinterpret_cast<const uint64_t*>(base + seqs_off);
      args_.n_words = int32_t(n_words);
      args_.key_pos = reinterpret_cast<const int32_t*>(base + pos_off);
    }
    for (int c = 0; c < 2; ++c) items_[c] = reinterpret_cast<const WorkItem*>(base + items_off[c]);
    out_begin_ = reinterpret_cast<const int64_t*>(base + begin_off);
    out_slots_ = reinterpret_cast<const int64_t*>(base + slots_off);
  }
};

}  // namespace cascade::cuda
