// Running a cascade plan on a CUDA device: cuda::Workspace.
//
//   cascade::Plan plan = cascade::Plan::two_level(shape, prefix, suffixes);  // KvViews hold DEVICE K/V
//   cascade::cuda::Workspace ws(plan);             // sizes the workspace, uploads the work list (once)
//   ws.attend(stream, q_dev, o_dev, lse_dev);      // every step: launches only
//
// The plan's KvViews point at device (or managed) K/V, f16 or bf16, one dtype for the whole plan. Their
// block tables are read on the host (Plan::build reads them there too) and copied into the workspace, so
// a table may be host or managed memory. The workspace keeps the K/V pointers, not the data: the K/V may
// change between calls, its addresses and lengths may not (make a new workspace when the plan changes).
//
// attend() is stream-ordered, allocates nothing, and only launches kernels, so it can be captured in a
// CUDA graph: the narrow kernel (segments with <= 16 stacked rows per KV head: the per-sequence pass,
// split-KV), the wide kernel (the shared-segment passes: all rows below a segment, sequences x GQA group, as
// the M dimension), then one merge of every output's partial states. q, o: (n_rows, n_q_heads, head_dim)
// f32 device memory, 16-byte aligned; lse: (n_rows, n_q_heads), natural log, or nullptr. A row that sees no
// key gets (0, -inf). The split baseline is a plan too (make_split / Plan::independent). The unified
// baseline (one buffer of all keys, every row scores every key under a sequence mask) is
// Workspace::unified. Errors (bad input, CUDA failures) throw cascade::Error.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

class Workspace {
 public:
  Workspace() = default;

  // The cascade path (and the split baseline, a Plan::independent).
  explicit Workspace(const Plan& plan, const Options& opt = {}) {
    const HeadShape& shape = plan.shape();
    init_shape(shape, plan.scale());
    DType dt = DType::f16;
    bool have_dt = false;
    for (int g = 0; g < plan.n_segments(); ++g) {
      const KvView& kv = plan.segment(g);
      if (kv.n_tokens == 0) continue;
      CASCADE_CHECK(!have_dt || kv.dtype == dt, "cuda::Workspace: segments mix K/V dtypes (",
                    dtype_name(dt), " and ", dtype_name(kv.dtype), " in segment ", g, ")");
      dt = kv.dtype, have_dt = true;
    }
    init_dtype(dt);
    n_rows_ = plan.n_rows();
    sched_ = make_schedule(plan, schedule_options(opt));
    std::vector<KvView> views;
    for (int g = 0; g < plan.n_segments(); ++g) views.push_back(plan.segment(g));
    upload(views, nullptr, 0, nullptr);
  }

  // The unified baseline: b.kv is the one device K/V buffer; b's masks (key_seqs, key_pos, row_seq,
  // row_pos) are host arrays, copied into the workspace. scale: the softmax scale (0: 1/sqrt(head_dim)).
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
    ws.init_dtype(b.kv.dtype);
    ws.n_rows_ = b.n_rows;
    ws.sched_ = make_unified_schedule(shape, b.kv.n_tokens, b.n_rows, b.row_seq, b.row_pos,
                                      ws.schedule_options(opt));
    ws.upload({b.kv}, b.key_seqs, b.n_words, b.key_pos);
    return ws;
  }

  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  Workspace(Workspace&& o) noexcept { *this = std::move(o); }
  Workspace& operator=(Workspace&& o) noexcept {
    if (this != &o) {
      release();
      shape_ = o.shape_, dtype_ = o.dtype_, scale_ = o.scale_, n_rows_ = o.n_rows_;
      sched_ = std::move(o.sched_);
      mem_ = o.mem_, bytes_ = o.bytes_, args_ = o.args_, out_begin_ = o.out_begin_, out_slots_ = o.out_slots_;
      n_items_[0] = o.n_items_[0], n_items_[1] = o.n_items_[1];
      items_[0] = o.items_[0], items_[1] = o.items_[1];
      o.mem_ = nullptr;
    }
    return *this;
  }
  ~Workspace() { release(); }

  // Attends q into o (and lse): see the top of this file.
  void attend(cudaStream_t stream, const float* q, float* o, float* lse = nullptr) const {
    if (n_rows_ == 0) return;
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
    merge_slots_kernel<<<state_detail::grid_for(n_out, 256), 256, 0, stream>>>(
        out_begin_, out_slots_, args_.part_o, args_.part_lse, n_out, d, o, lse);
    CASCADE_CUDA_CHECK(cudaGetLastError(), "launching the merge of ", n_out, " outputs");
  }

  const Schedule& schedule() const { return sched_; }
  int64_t device_bytes() const { return bytes_; }  // everything the workspace holds on the device
  const HeadShape& shape() const { return shape_; }
  int64_t n_rows() const { return n_rows_; }

 private:
  HeadShape shape_;
  DType dtype_ = DType::f16;
  float scale_ = 1.0f;
  int64_t n_rows_ = 0;
  Schedule sched_;
  void* mem_ = nullptr;
  int64_t bytes_ = 0;
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
    mem_ = nullptr;
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
    CASCADE_CHECK(dt == DType::f16 || dt == DType::bf16, "cuda::Workspace: K/V dtype ", dtype_name(dt),
                  " is not supported on CUDA (f16, bf16)");
    dtype_ = dt;
    dispatch(Configure{});
  }

  ScheduleOptions schedule_options(const Options& opt) const {
    ScheduleOptions so;
    so.n_sm = opt.n_sm > 0 ? opt.n_sm : multiprocessor_count();
    so.blocks_per_sm = opt.blocks_per_sm;
    return so;
  }

  template <class F>
  void dispatch(F&& f) const {
    dispatch_head_dim(shape_.head_dim, [&]<int D>() {
      if (dtype_ == DType::f16)
        f.template operator()<__half, D>();
      else
        f.template operator()<__nv_bfloat16, D>();
    });
  }

  void launch(const LaunchArgs& args, int cfg, cudaStream_t stream) const {
    dispatch([&]<class T, int D>() { launch_attention<T, D>(args, cfg, stream); });
  }

  // Lays out every array in one device allocation and copies the static ones in one transfer.
  void upload(const std::vector<KvView>& views, const uint64_t* key_seqs, int64_t n_words, const int32_t* key_pos) {
    const int d = shape_.head_dim;
    std::vector<unsigned char> blob;
    const auto put = [&](const void* p, size_t n) {
      const size_t off = (blob.size() + 255) / 256 * 256;
      blob.resize(off + n);
      if (n) std::memcpy(blob.data() + off, p, n);
      return off;
    };
    std::vector<PassDesc> passes(views.size());
    std::vector<size_t> table_off(views.size(), SIZE_MAX);
    for (size_t g = 0; g < views.size(); ++g) {
      const KvView& kv = views[g];
      PassDesc& p = passes[g];
      p.n_tokens = int32_t(kv.n_tokens);
      p.row_begin = g < sched_.pass_row_begin.size() ? sched_.pass_row_begin[g] : 0;
      p.n_token_rows = 0;
      if (kv.n_tokens == 0) continue;
      const std::string what = "segment " + std::to_string(g);
      CASCADE_CHECK(is_device_pointer(kv.k) && is_device_pointer(kv.v), what,
                    ": K/V is not device memory (the CUDA path reads K/V where the KvView points)");
      p.k = kv.k, p.v = kv.v;
      p.stride_token = kv.stride_token, p.stride_head = kv.stride_head;
      const auto al = [](int64_t x) { return x % 8 == 0; };  // 16 bytes of 2-byte elements
      p.vec16 = reinterpret_cast<uintptr_t>(kv.k) % 16 == 0 && reinterpret_cast<uintptr_t>(kv.v) % 16 == 0 &&
                al(kv.stride_token) && al(kv.stride_head) && (!kv.paged() || al(kv.stride_page));
      if (kv.paged()) {
        CASCADE_CHECK(kv.page_size <= INT32_MAX, what, ": page size ", kv.page_size, " does not fit in 32 bits");
        p.page_size = int32_t(kv.page_size);
        p.stride_page = kv.stride_page;
        const int64_t n_pages = (kv.n_tokens + kv.page_size - 1) / kv.page_size;
        table_off[g] = put(kv.block_table, size_t(n_pages) * sizeof(int32_t));
      }
    }
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
    const int64_t n_keys = views.empty() ? 0 : views[0].n_tokens;
    if (key_pos) {
      seqs_off = put(key_seqs, size_t(n_keys * n_words) * sizeof(uint64_t));
      pos_off = put(key_pos, size_t(n_keys) * sizeof(int32_t));
    }
    const size_t passes_off = put(passes.data(), passes.size() * sizeof(PassDesc));  // patched below
    const size_t static_bytes = (blob.size() + 255) / 256 * 256;
    const size_t o_bytes = size_t(sched_.n_slots) * size_t(d) * sizeof(float);
    const size_t total = static_bytes + o_bytes + size_t(sched_.n_slots) * sizeof(float) + 256;
    CASCADE_CUDA_CHECK(cudaMalloc(&mem_, total), "cuda::Workspace: allocating ", total, " bytes");
    bytes_ = int64_t(total);
    auto* base = static_cast<unsigned char*>(mem_);
    for (size_t g = 0; g < passes.size(); ++g)
      if (table_off[g] != SIZE_MAX) passes[g].block_table = reinterpret_cast<const int32_t*>(base + table_off[g]);
    std::memcpy(blob.data() + passes_off, passes.data(), passes.size() * sizeof(PassDesc));
    CASCADE_CUDA_CHECK(cudaMemcpy(mem_, blob.data(), blob.size(), cudaMemcpyHostToDevice),
                       "cuda::Workspace: uploading the work list");
    args_ = LaunchArgs{};
    args_.passes = reinterpret_cast<const PassDesc*>(base + passes_off);
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
