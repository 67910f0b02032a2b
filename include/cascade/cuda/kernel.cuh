// The CUDA attention kernel: one thread block per work item (schedule.hpp), tensor cores for both
// products (mma.sync m16n8k16, f16 or bf16 operands, f32 accumulation; sm_80 and later).
//
// A block attends up to BM stacked query rows of one pass and one KV head to the tokens [t0, t1):
//   - Q: the rows' f32 queries, converted to the tile type T into shared memory once; T is the K/V type, or f16
//     for q8_0 K/V;
//   - K/V: tiles of BN tokens, copied into shared memory two stages deep (cp.async, 16-byte vectors when the
//     rows are aligned, element copies otherwise), token by token through the block table when paged; q8_0
//     codes are read 8 at a time with their block's scale and stored into the tile as f16 (code x scale rounded
//     once), so the cache itself is never expanded;
//   - warp (wm, wn) owns rows [16 wm, 16 wm + 16) and tokens [NW wn, NW wn + NW) of each tile:
//     S = Q K^T on tensor cores, scale and mask in registers, online softmax in base 2 (m, l per row),
//     P (rounded to T) V on tensor cores into f32 accumulators;
//   - when the warps split the tokens (WN > 1) their states are merged through shared memory;
//   - the block writes its rows' normalized partial states (o, lse natural log) to their slots; a row that
//     saw no key writes (0, -inf).
// Masks: a plan pass shows row r the pass's tokens [rows[r].first, rows[r].limit) (causal, sliding window, and
// empty rows); the unified baseline shows key j to row r when j belongs to r's sequence and key_pos[j] <= r's
// position (and > r's position - window under a sliding window).
//
// The kernel's steps, in the shape of FlashInfer's prefill kernel (scores, state update, P V, normalize):
// load_q; per tile load_kv_tile (the next stage), compute_scores, mask_scores, update_state (online softmax),
// accumulate_pv; then write_rows (a warp holds whole rows) or merge_warps_and_write (the warps split the tokens).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cascade/cuda/common.cuh"
#include "cascade/cuda/work.hpp"
#include "cascade/q8_0.hpp"

namespace cascade::cuda {

// The kernels' K/V storage types: __half, __nv_bfloat16, or Q8_0 (int8 codes with an f16 scale per 32: q8_0.hpp),
// whose tiles are f16 in shared memory. TileType<Kv>: the type of the tiles and of the tensor-core products.
struct Q8_0 {};
template <class Kv> struct TileType { using type = Kv; };
template <> struct TileType<Q8_0> { using type = __half; };

// Everything a launch reads, in device memory except the scalars.
struct LaunchArgs {
  const WorkItem* items = nullptr;
  int32_t n_items = 0;
  const PassDesc* passes = nullptr;
  const RowDesc* rows = nullptr;
  const float* q = nullptr;  // (n_rows, n_q_heads, head_dim) f32
  int32_t n_q_heads = 0;
  int32_t group = 1;
  float scale_log2 = 0;  // softmax scale * log2(e)
  float* part_o = nullptr;    // (slots, head_dim)
  float* part_lse = nullptr;  // (slots), natural log
  // Unified baseline only (nullptr for plans): key masks of the one pass.
  const uint64_t* key_seqs = nullptr;  // (n_keys, n_words)
  int32_t n_words = 0;
  const int32_t* key_pos = nullptr;    // (n_keys)
  int32_t window = 0;                  // sliding window (0: none)
};

// Head dims with a compiled kernel.
inline bool head_dim_supported(int d) { return d == 64 || d == 80 || d == 96 || d == 128 || d == 256; }

// Launches the kernel of configuration cfg (kNarrow or kWide) over args.items. Kv: __half, __nv_bfloat16 or Q8_0
// (head dims that are multiples of 32). configure(): raises the kernels' shared-memory limit once; call it before
// the first launch and outside stream capture.
template <class Kv, int D>
void launch_attention(const LaunchArgs& args, int cfg, cudaStream_t stream);
template <class Kv, int D>
void configure_attention();

// Calls f.template operator()<D>() with D the head dim (FlashInfer's DISPATCH_HEAD_DIM, as a function).
template <class F>
void dispatch_head_dim(int d, F&& f) {
  switch (d) {
    case 64: return f.template operator()<64>();
    case 80: return f.template operator()<80>();
    case 96: return f.template operator()<96>();
    case 128: return f.template operator()<128>();
    case 256: return f.template operator()<256>();
  }
  ::cascade::detail::fail("CUDA attention: head_dim ", d, " has no kernel (64, 80, 96, 128, 256)");
}

#if defined(__CUDACC__)

namespace kernel {

// The operands of one m16n8k16 tensor-core product c += a b: c four f32 accumulators, a four registers and b
// two of T pairs (the PTX fragment layouts).
#define CASCADE_MMA_OPERANDS(c, a, b0, b1)                 \
  : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])         \
  : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1)
#define CASCADE_MMA_REGS " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"

// What the kernel needs of its K/V type T: f32 -> T rounding to nearest, alone and in pairs, and the product.
template <class T> struct Mma;
template <> struct Mma<__half> {
  __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
  __device__ __forceinline__ static __half2 from_floats(float lo, float hi) { return __floats2half2_rn(lo, hi); }
  __device__ __forceinline__ static void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" CASCADE_MMA_REGS
                 CASCADE_MMA_OPERANDS(c, a, b0, b1));
  }
};
template <> struct Mma<__nv_bfloat16> {
  __device__ __forceinline__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ __forceinline__ static __nv_bfloat162 from_floats(float lo, float hi) {
    return __floats2bfloat162_rn(lo, hi);
  }
  __device__ __forceinline__ static void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" CASCADE_MMA_REGS
                 CASCADE_MMA_OPERANDS(c, a, b0, b1));
  }
};
#undef CASCADE_MMA_REGS
#undef CASCADE_MMA_OPERANDS

// Two f32 rounded to T, lo in the low half: one register of an A operand.
template <class T>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  const auto h = Mma<T>::from_floats(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// 16-byte asynchronous copy; src_bytes = 0 fills the destination with zeros.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Tile shapes of a configuration (schedule.hpp: kNarrow, kWide).
template <int D, int Cfg>
struct Shape {
  static constexpr int BN = (Cfg == kWide && D > 128) ? 32 : (Cfg == kNarrow && D > 128 ? 32 : 64);
  static constexpr int WM = Cfg == kWide ? 4 : 1;            // warps along the rows
  static constexpr int WN = Cfg == kWide ? 1 : BN / 16;      // warps along the tokens
  static constexpr int BM = 16 * WM;
  static constexpr int NW = BN / WN;                         // tokens per warp per tile
  static constexpr int kThreads = 32 * WM * WN;
  static constexpr int LD = D + 8;                           // shared row stride: 16 bytes of padding
  static constexpr bool kQInRegs = D <= 128;
  static constexpr int kQFrags = kQInRegs ? D / 16 : 1;     // Q fragments a thread holds in registers
  static constexpr int kQBytes = BM * LD * 2;
  static constexpr int kKvBytes = 2 * 2 * BN * LD * 2;      // K and V, two stages
  static constexpr int kMergeBytes = WN > 1 ? WN * 16 * (D + 2) * 4 : 0;
  static constexpr int kStageBytes = kKvBytes > kMergeBytes ? kKvBytes : kMergeBytes;  // K/V, later the merge
  static constexpr int kMetaBytes = 4 * BM * 4;
  static constexpr int kSmemBytes = kQBytes + kStageBytes + kMetaBytes;
  static_assert(D % 16 == 0 && NW % 16 == 0 && BN % 16 == 0, "tile shape");
};

// The block's shared memory (Shape::kSmemBytes): Q as T (BM rows of stride LD), the K/V stages
// [stage][K|V][BN][LD] (after the last tile, the warps' merge buffer in the same bytes), then each row's mask
// data: limit, sequence, position, first visible token (BM each).
template <class T, int D, int Cfg>
struct Smem {
  using S = Shape<D, Cfg>;
  unsigned char* base;
  T* q;
  T* kv;
  int32_t* lim;
  int32_t* seq;
  int32_t* pos;
  int32_t* first;

  __device__ __forceinline__ explicit Smem(unsigned char* smem)
      : base(smem),
        q(reinterpret_cast<T*>(smem)),
        kv(reinterpret_cast<T*>(smem + S::kQBytes)),
        lim(reinterpret_cast<int32_t*>(smem + S::kQBytes + S::kStageBytes)),
        seq(lim + S::BM),
        pos(seq + S::BM),
        first(pos + S::BM) {}
  __device__ __forceinline__ float* merge() const { return reinterpret_cast<float*>(base + S::kQBytes); }
};

// The mask data of a thread's two rows (fragment rows lane/4 and lane/4 + 8 of its warp's 16).
struct RowPair {
  int lim_a, lim_b;
  int seq_a, seq_b;
  int pos_a, pos_b;
  int first_a, first_b;
};

// Stacked rows [0, BM) of the item into shared memory: their queries rounded to T (zeros past n_rows), and
// their mask data (a row past n_rows sees nothing).
template <class T, int D, int Cfg>
__device__ __forceinline__ void load_q(const LaunchArgs& args, const WorkItem& it, const PassDesc& ps,
                                       const Smem<T, D, Cfg>& sm, int tid) {
  using S = Shape<D, Cfg>;
  constexpr int BM = S::BM, LD = S::LD;
  for (int i = tid; i < BM * (D / 4); i += S::kThreads) {
    const int r = i / (D / 4), c = (i % (D / 4)) * 4;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < it.n_rows) {
      const int e = it.e0 + r;
      const RowDesc rd = args.rows[ps.row_begin + e / args.group];
      const int qh = it.kvh * args.group + e % args.group;
      x = *reinterpret_cast<const float4*>(args.q + (int64_t(rd.q_row) * args.n_q_heads + qh) * D + c);
    }
    T* dst = sm.q + r * LD + c;
    dst[0] = Mma<T>::from_float(x.x);
    dst[1] = Mma<T>::from_float(x.y);
    dst[2] = Mma<T>::from_float(x.z);
    dst[3] = Mma<T>::from_float(x.w);
  }
  for (int r = tid; r < BM; r += S::kThreads) {
    int32_t lim = 0, seq = 0, pos = -1, first = 0;
    if (r < it.n_rows) {
      const RowDesc rd = args.rows[ps.row_begin + (it.e0 + r) / args.group];
      lim = rd.limit, seq = rd.seq, pos = rd.pos, first = rd.first;
    }
    sm.lim[r] = lim, sm.seq[r] = seq, sm.pos[r] = pos, sm.first[r] = first;
  }
}

// Eight q8_0 codes times their block's scale, rounded to f16: one 16-byte row chunk of a tile. aligned: the codes
// start on 8 bytes (one vector load).
__device__ __forceinline__ uint4 dequantize8(const int8_t* codes, const __half* scale, bool aligned) {
  int8_t c[8];
  if (aligned) {
    const int2 w = *reinterpret_cast<const int2*>(codes);
    memcpy(c, &w, 8);
  } else {
#pragma unroll
    for (int u = 0; u < 8; ++u) c[u] = codes[u];
  }
  const float d = __half2float(*scale);
  uint4 r;
  uint32_t* w = reinterpret_cast<uint32_t*>(&r);
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const __half2 h = __floats2half2_rn(float(c[2 * u]) * d, float(c[2 * u + 1]) * d);
    w[u] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return r;
}

// Copies tokens [a, a + BN) of K and V (zeros past t1) into stage st: 16-byte cp.async copies when the
// pass's rows are aligned, element copies otherwise; token by token through the block table when paged. q8_0:
// the codes and scales are read by the threads and stored as f16 (loads, not asynchronous copies).
template <class Kv, int D, int Cfg>
__device__ __forceinline__ void load_kv_tile(const WorkItem& it, const PassDesc& ps,
                                             typename TileType<Kv>::type* skv, int a, int st, int tid) {
  using S = Shape<D, Cfg>;
  using T = typename TileType<Kv>::type;
  constexpr int BN = S::BN, LD = S::LD;
  constexpr int kChunks = D / 8;  // 16-byte chunks per tile row (8 elements)
  T* sk = skv + st * 2 * BN * LD;
  T* sv = sk + BN * LD;
  for (int i = tid; i < BN * kChunks; i += S::kThreads) {
    const int j = i / kChunks, c = (i % kChunks) * 8;
    const int t = a + j;
    const bool in = t < it.t1;
    int64_t off = 0;  // in elements (q8_0: codes)
    if (in) {
      off = ps.page_size == 0 ? int64_t(t) * ps.stride_token
                              : int64_t(ps.block_table[t / ps.page_size]) * ps.stride_page +
                                    int64_t(t % ps.page_size) * ps.stride_token;
      off += int64_t(it.kvh) * ps.stride_head + c;
    }
    T* dk = sk + j * LD + c;
    T* dv = sv + j * LD + c;
    if constexpr (std::is_same_v<Kv, Q8_0>) {
      // Strides are multiples of 32 codes, so the scale of codes [off, off + 8) is that of their 32-code block.
      uint4 k8 = make_uint4(0u, 0u, 0u, 0u), v8 = k8;
      if (in) {
        k8 = dequantize8(static_cast<const int8_t*>(ps.k) + off,
                         static_cast<const __half*>(ps.k_scales) + off / kQ8Block, ps.vec16);
        v8 = dequantize8(static_cast<const int8_t*>(ps.v) + off,
                         static_cast<const __half*>(ps.v_scales) + off / kQ8Block, ps.vec16);
      }
      *reinterpret_cast<uint4*>(dk) = k8;
      *reinterpret_cast<uint4*>(dv) = v8;
    } else if (ps.vec16) {
      cp_async16(dk, static_cast<const T*>(ps.k) + off, in ? 16 : 0);
      cp_async16(dv, static_cast<const T*>(ps.v) + off, in ? 16 : 0);
    } else {
      const uint16_t* gk = reinterpret_cast<const uint16_t*>(static_cast<const T*>(ps.k) + off);
      const uint16_t* gv = reinterpret_cast<const uint16_t*>(static_cast<const T*>(ps.v) + off);
      uint16_t* k16 = reinterpret_cast<uint16_t*>(dk);
      uint16_t* v16 = reinterpret_cast<uint16_t*>(dv);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        k16[u] = in ? gk[u] : uint16_t(0);
        v16[u] = in ? gv[u] : uint16_t(0);
      }
    }
  }
}

// Scores: S = Q K^T for this warp's 16 rows (from row0 of sq, or qf when Q is held in registers) and NW tokens
// (from tok0 of the stage's K, sk), as (16, NW) accumulators s[n8 tile][4].
template <class T, int D, int Cfg>
__device__ __forceinline__ void compute_scores(float (&s)[Shape<D, Cfg>::NW / 8][4],
                                               const uint32_t (&qf)[Shape<D, Cfg>::kQFrags][4], const T* sq,
                                               const T* sk, int row0, int tok0, int lane) {
  using S = Shape<D, Cfg>;
  constexpr int NW = S::NW, LD = S::LD;
#pragma unroll
  for (int i = 0; i < NW / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t qa[4];
    if constexpr (S::kQInRegs) {
      qa[0] = qf[kk][0], qa[1] = qf[kk][1], qa[2] = qf[kk][2], qa[3] = qf[kk][3];
    } else {
      ldmatrix_x4(qa, sq + (row0 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
    }
#pragma unroll
    for (int np = 0; np < NW / 16; ++np) {
      uint32_t b[4];
      const int mi = lane >> 3;
      ldmatrix_x4(b, sk + (tok0 + np * 16 + (mi >> 1) * 8 + (lane & 7)) * LD + kk * 16 + (mi & 1) * 8);
      Mma<T>::mma(s[2 * np], qa, b[0], b[1]);
      Mma<T>::mma(s[2 * np + 1], qa, b[2], b[3]);
    }
  }
}

// Scales the scores into base 2, masks them (-inf for a key the row does not see) and takes each row's max
// over this thread's columns into mx_a, mx_b (in the masking loop: a loop of its own compiles to other code).
// j0: the pass token of the warp's first key in the tile. Plans show row r the keys first <= j < min(t1, limit);
// the unified baseline (a key mask) the keys j < t1 of r's sequence at positions <= r's (within the window).
template <int D, int Cfg>
__device__ __forceinline__ void mask_scores(float (&s)[Shape<D, Cfg>::NW / 8][4], const LaunchArgs& args,
                                            const WorkItem& it, bool unified, const RowPair& rp, int j0,
                                            int lane, float& mx_a, float& mx_b) {
  constexpr int NW = Shape<D, Cfg>::NW;
#pragma unroll
  for (int nt = 0; nt < NW / 8; ++nt) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int j = j0 + nt * 8 + 2 * (lane & 3) + u;  // the key's token index in the pass
      bool vis_a, vis_b;
      if (unified) {
        bool in_a = false, in_b = false;
        if (j < it.t1) {
          const int kp = args.key_pos[j];
          const uint64_t* bits = args.key_seqs + int64_t(j) * args.n_words;
          in_a = ((bits[rp.seq_a >> 6] >> (rp.seq_a & 63)) & 1u) && kp <= rp.pos_a &&
                 (args.window <= 0 || kp > rp.pos_a - args.window);
          in_b = ((bits[rp.seq_b >> 6] >> (rp.seq_b & 63)) & 1u) && kp <= rp.pos_b &&
                 (args.window <= 0 || kp > rp.pos_b - args.window);
        }
        vis_a = in_a, vis_b = in_b;
      } else {
        vis_a = j < it.t1 && j < rp.lim_a && j >= rp.first_a;
        vis_b = j < it.t1 && j < rp.lim_b && j >= rp.first_b;
      }
      s[nt][u] = vis_a ? s[nt][u] * args.scale_log2 : -INFINITY;
      s[nt][2 + u] = vis_b ? s[nt][2 + u] * args.scale_log2 : -INFINITY;
      mx_a = fmaxf(mx_a, s[nt][u]);
      mx_b = fmaxf(mx_b, s[nt][2 + u]);
    }
  }
}

// State update (online softmax) of the two rows with one tile's masked scores and their maxima over this
// thread's columns (mx_a, mx_b): the new running max, the scores turned into P = exp2(s - m) in place, and l
// and o rescaled to the new max, l plus P's row sums.
template <int D, int Cfg>
__device__ __forceinline__ void update_state(float (&s)[Shape<D, Cfg>::NW / 8][4], float mx_a, float mx_b,
                                             float (&o)[D / 8][4], float& m_a, float& m_b, float& l_a,
                                             float& l_b) {
  constexpr int NW = Shape<D, Cfg>::NW;
  mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
  mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
  mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
  mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
  const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
  // Reference points: 0 while a row has seen nothing, so no (-inf) - (-inf) appears.
  const float ref_a = mn_a == -INFINITY ? 0.f : mn_a, ref_b = mn_b == -INFINITY ? 0.f : mn_b;
  const float alpha_a = exp2f(m_a - ref_a), alpha_b = exp2f(m_b - ref_b);
  m_a = mn_a, m_b = mn_b;
  float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
  for (int nt = 0; nt < NW / 8; ++nt) {
    s[nt][0] = exp2f(s[nt][0] - ref_a);
    s[nt][1] = exp2f(s[nt][1] - ref_a);
    s[nt][2] = exp2f(s[nt][2] - ref_b);
    s[nt][3] = exp2f(s[nt][3] - ref_b);
    sum_a += s[nt][0] + s[nt][1];
    sum_b += s[nt][2] + s[nt][3];
  }
  l_a = l_a * alpha_a + sum_a;
  l_b = l_b * alpha_b + sum_b;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    o[i][0] *= alpha_a, o[i][1] *= alpha_a;
    o[i][2] *= alpha_b, o[i][3] *= alpha_b;
  }
}

// O += P V over the warp's NW tokens of the stage's V (sv, from tok0). P's accumulator layout is the A
// operand's layout (two n8 tiles = one k16 step); P is rounded to T.
template <class T, int D, int Cfg>
__device__ __forceinline__ void accumulate_pv(float (&o)[D / 8][4], const float (&p)[Shape<D, Cfg>::NW / 8][4],
                                              const T* sv, int tok0, int lane) {
  using S = Shape<D, Cfg>;
  constexpr int NW = S::NW, LD = S::LD;
#pragma unroll
  for (int kt = 0; kt < NW / 16; ++kt) {
    uint32_t pa[4];
    pa[0] = pack<T>(p[2 * kt][0], p[2 * kt][1]);
    pa[1] = pack<T>(p[2 * kt][2], p[2 * kt][3]);
    pa[2] = pack<T>(p[2 * kt + 1][0], p[2 * kt + 1][1]);
    pa[3] = pack<T>(p[2 * kt + 1][2], p[2 * kt + 1][3]);
    const int mi = lane >> 3;
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, sv + (tok0 + kt * 16 + (mi & 1) * 8 + (lane & 7)) * LD + dp * 16 + (mi >> 1) * 8);
      Mma<T>::mma(o[2 * dp], pa, b[0], b[1]);
      Mma<T>::mma(o[2 * dp + 1], pa, b[2], b[3]);
    }
  }
}

constexpr float kLn2 = 0.6931471805599453f;

// Normalize and write when one warp holds whole rows (WN == 1): rows ra and rb of the block (those below
// n_rows), o times 1 / l into their slots, and from the quad's first thread their lse (natural log; -inf when
// the row saw no key).
template <int D>
__device__ __forceinline__ void write_rows(const LaunchArgs& args, const WorkItem& it, const float (&o)[D / 8][4],
                                           float m_a, float m_b, float l_a, float l_b, int ra, int rb, int lane) {
  const int cq = 2 * (lane & 3);  // this thread's first column in each n8 tile
  const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
  if (ra < it.n_rows) {
    float* dst = args.part_o + (it.slot + ra) * D;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<float2*>(dst + i * 8 + cq) = make_float2(o[i][0] * inv_a, o[i][1] * inv_a);
    if ((lane & 3) == 0) args.part_lse[it.slot + ra] = l_a > 0.f ? (m_a + log2f(l_a)) * kLn2 : -INFINITY;
  }
  if (rb < it.n_rows) {
    float* dst = args.part_o + (it.slot + rb) * D;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<float2*>(dst + i * 8 + cq) = make_float2(o[i][2] * inv_b, o[i][3] * inv_b);
    if ((lane & 3) == 0) args.part_lse[it.slot + rb] = l_b > 0.f ? (m_b + log2f(l_b)) * kLn2 : -INFINITY;
  }
}

// Normalize and write when the warps split the tokens (WN > 1): merge their (m, l, unnormalized o) per row
// through shared memory (the K/V stages are free by now), then write each row's normalized state. Layout of
// the buffer: [wn][16 rows][D + 2]: o, then m and l.
template <class T, int D, int Cfg>
__device__ __forceinline__ void merge_warps_and_write(const LaunchArgs& args, const WorkItem& it,
                                                      const float (&o)[D / 8][4], float m_a, float m_b,
                                                      float l_a, float l_b, const Smem<T, D, Cfg>& sm, int tid,
                                                      int lane, int wn) {
  using S = Shape<D, Cfg>;
  constexpr int WN = S::WN;
  const int cq = 2 * (lane & 3);  // this thread's first column in each n8 tile
  __syncthreads();
  float* buf = sm.merge();
  float* mine = buf + wn * 16 * (D + 2);
  const int la = lane >> 2, lb = la + 8;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    *reinterpret_cast<float2*>(mine + la * (D + 2) + i * 8 + cq) = make_float2(o[i][0], o[i][1]);
    *reinterpret_cast<float2*>(mine + lb * (D + 2) + i * 8 + cq) = make_float2(o[i][2], o[i][3]);
  }
  if ((lane & 3) == 0) {
    mine[la * (D + 2) + D] = m_a, mine[la * (D + 2) + D + 1] = l_a;
    mine[lb * (D + 2) + D] = m_b, mine[lb * (D + 2) + D + 1] = l_b;
  }
  __syncthreads();
  for (int i = tid; i < 16 * D; i += S::kThreads) {
    const int r = i / D, d = i % D;
    if (r >= it.n_rows) continue;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < WN; ++w) m = fmaxf(m, buf[(w * 16 + r) * (D + 2) + D]);
    float l = 0.f, acc = 0.f;
    if (m != -INFINITY) {
#pragma unroll
      for (int w = 0; w < WN; ++w) {
        const float* row = buf + (w * 16 + r) * (D + 2);
        const float c = exp2f(row[D] - m);  // 0 for a warp that saw nothing
        l += c * row[D + 1];
        acc += c * row[d];
      }
    }
    args.part_o[(it.slot + r) * D + d] = l > 0.f ? acc / l : 0.f;
    if (d == 0) args.part_lse[it.slot + r] = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
  }
}

template <class Kv, int D, int Cfg>
__global__ void __launch_bounds__(Shape<D, Cfg>::kThreads)
    attention_kernel(const LaunchArgs args) {
  using T = typename TileType<Kv>::type;
  using S = Shape<D, Cfg>;
  constexpr int BN = S::BN, NW = S::NW, LD = S::LD, WN = S::WN;
  extern __shared__ __align__(16) unsigned char smem[];
  const Smem<T, D, Cfg> sm(smem);

  const WorkItem it = args.items[blockIdx.x];
  const PassDesc ps = args.passes[it.pass];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WN, wn = warp % WN;
  const bool unified = args.key_pos != nullptr;

  load_q<T, D, Cfg>(args, it, ps, sm, tid);
  const int n_tiles = (it.t1 - it.t0 + BN - 1) / BN;
  load_kv_tile<Kv, D, Cfg>(it, ps, sm.kv, it.t0, 0, tid);
  cp_async_commit();
  __syncthreads();  // Q and the row data are in shared memory

  const int row0 = wm * 16;  // this warp's first row in the block
  uint32_t qf[S::kQFrags][4];
  if constexpr (S::kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      ldmatrix_x4(qf[kk], sm.q + (row0 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
  }
  // This thread's two rows (fragment rows lane/4 and lane/4 + 8) and their mask data.
  const int ra = row0 + (lane >> 2), rb = ra + 8;
  const RowPair rp{sm.lim[ra],   sm.lim[rb],   sm.seq[ra],   sm.seq[rb],
                   sm.pos[ra],   sm.pos[rb],   sm.first[ra], sm.first[rb]};

  // This thread's part of its two rows' running state: o, unnormalized, in the accumulator layout of a
  // (16, D) product (o[i][0..1] row a, o[i][2..3] row b); m, the running max of the scores (base 2); l, the sum
  // of exp2(score - m) over this thread's columns (the quad's four threads add theirs up at the end).
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int a = it.t0 + tile * BN;
    if (tile + 1 < n_tiles) load_kv_tile<Kv, D, Cfg>(it, ps, sm.kv, a + BN, (tile + 1) & 1, tid);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* sk = sm.kv + (tile & 1) * 2 * BN * LD;
    const T* sv = sk + BN * LD;
    const int tok0 = wn * NW;  // this warp's first token in the tile

    float s[NW / 8][4];
    compute_scores<T, D, Cfg>(s, qf, sm.q, sk, row0, tok0, lane);
    float mx_a = -INFINITY, mx_b = -INFINITY;
    mask_scores<D, Cfg>(s, args, it, unified, rp, a + tok0, lane, mx_a, mx_b);
    update_state<D, Cfg>(s, mx_a, mx_b, o, m_a, m_b, l_a, l_b);
    accumulate_pv<T, D, Cfg>(o, s, sv, tok0, lane);
    __syncthreads();  // the stage is read by every warp before the next load overwrites it
  }
  cp_async_wait<0>();

  // Each row's sum lives spread over the four threads of its quad.
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);

  if constexpr (WN == 1) {
    write_rows<D>(args, it, o, m_a, m_b, l_a, l_b, ra, rb, lane);
  } else {
    merge_warps_and_write<T, D, Cfg>(args, it, o, m_a, m_b, l_a, l_b, sm, tid, lane, wn);
  }
}

}  // namespace kernel

template <class Kv, int D>
void configure_attention() {
  static_assert(!std::is_same_v<Kv, Q8_0> || D % kQ8Block == 0, "q8_0 K/V: head dims that are multiples of 32");
  CASCADE_CUDA_CHECK(cudaFuncSetAttribute(kernel::attention_kernel<Kv, D, kNarrow>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          kernel::Shape<D, kNarrow>::kSmemBytes),
                     "raising the shared-memory limit of the narrow attention kernel (head_dim ", D, ")");
  CASCADE_CUDA_CHECK(cudaFuncSetAttribute(kernel::attention_kernel<Kv, D, kWide>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          kernel::Shape<D, kWide>::kSmemBytes),
                     "raising the shared-memory limit of the wide attention kernel (head_dim ", D, ")");
}

template <class Kv, int D>
void launch_attention(const LaunchArgs& args, int cfg, cudaStream_t stream) {
  if (args.n_items == 0) return;
  if (cfg == kNarrow) {
    using S = kernel::Shape<D, kNarrow>;
    kernel::attention_kernel<Kv, D, kNarrow><<<args.n_items, S::kThreads, S::kSmemBytes, stream>>>(args);
  } else {
    using S = kernel::Shape<D, kWide>;
    kernel::attention_kernel<Kv, D, kWide><<<args.n_items, S::kThreads, S::kSmemBytes, stream>>>(args);
  }
  CASCADE_CUDA_CHECK(cudaGetLastError(), "launching the ", cfg == kNarrow ? "narrow" : "wide",
                     " attention kernel (head_dim ", D, ", ", args.n_items, " blocks)");
}

#endif  // __CUDACC__

// Explicit instantiations live in kernels/cuda (the cascade_cuda library); users who compile the templates
// themselves leave CASCADE_CUDA_EXTERN_KERNELS undefined.
#if defined(CASCADE_CUDA_EXTERN_KERNELS)
#define CASCADE_CUDA_ATTENTION_EXTERN(T, D)                                               \
  extern template void launch_attention<T, D>(const LaunchArgs&, int, cudaStream_t); \
  extern template void configure_attention<T, D>();
#define CASCADE_CUDA_ATTENTION_EXTERN_ALL(T) \
  CASCADE_CUDA_ATTENTION_EXTERN(T, 64)       \
  CASCADE_CUDA_ATTENTION_EXTERN(T, 80)       \
  CASCADE_CUDA_ATTENTION_EXTERN(T, 96)       \
  CASCADE_CUDA_ATTENTION_EXTERN(T, 128)      \
  CASCADE_CUDA_ATTENTION_EXTERN(T, 256)
CASCADE_CUDA_ATTENTION_EXTERN_ALL(__half)
CASCADE_CUDA_ATTENTION_EXTERN_ALL(__nv_bfloat16)
CASCADE_CUDA_ATTENTION_EXTERN(Q8_0, 64)  // q8_0: head dims that are multiples of 32
CASCADE_CUDA_ATTENTION_EXTERN(Q8_0, 96)
CASCADE_CUDA_ATTENTION_EXTERN(Q8_0, 128)
CASCADE_CUDA_ATTENTION_EXTERN(Q8_0, 256)
#endif

}  // namespace cascade::cuda
