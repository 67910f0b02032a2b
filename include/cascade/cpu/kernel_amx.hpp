// The shared-pass kernel for bf16 K/V on AMX tiles (AMX-TILE and AMX-BF16: Sapphire Rapids and later Xeons).
//
// A tdpbf16ps multiplies a 16 x 32 bf16 tile by a 32 x 16 one into a 16 x 16 f32 tile: 8,192 multiply-adds per
// instruction, about 16x the rate of AVX-512 f32 FMAs on one core. The kernel computes the transposed products
// so that, as in the AVX-512 kernels, a vector register holds one key's scores for 16 query rows and the online
// softmax runs lane-wise between them:
//   S^T (32 keys x 16 rows)  = K (keys x head dim, as stored)   * Q^T (head-dim pairs x rows, packed once)
//   O^T (head dim x 16 rows) += V^T (head dim x keys, per tile) * P^T (key pairs x rows, from the softmax)
// S^T goes to a 2 KB buffer in L1 and back; the softmax (f32, AVX-512) writes P^T as bf16 key pairs, which is
// the layout the second product takes. K tiles load from the KV cache as stored; V^T is built once per K/V
// tile of up to 128 keys and read by every row block. The rounding is that of the vdpbf16ps kernel
// (kernel_bf16.hpp: q and the softmax weights rounded to bf16, sums in f32), so the two share one error bound:
// |o - o_exact| <= 2^-8 sum_j w_j |v_j|.
//
// Tiles are per-thread state: each call loads the tile configuration and releases the tiles when it returns.
// The OS must grant a process the tile data (Linux: arch_prctl ARCH_REQ_XCOMP_PERM); amx_usable() (simd.hpp)
// asks once, and the plan chooses this kernel only where it was granted (kernel.hpp: choose_kernel).
//
// Built on the vdpbf16ps policies (kernel_bf16.hpp: their key pairing, the driver compiled for AVX512_BF16).
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <cstdint>
#include <cstring>

#include "cascade/cpu/kernel_bf16.hpp"

#if CASCADE_X86 && defined(__x86_64__)
#define CASCADE_AMX_KERNEL 1

// The tile instructions, written here rather than taken from the compiler's intrinsics: those need the AMX
// target options, and their tile loads do not tell the compiler that they read memory, so it may move a store
// of the data they load (P^T, O^T) past them. Every load and store here is ordered with the code around it.
#define CASCADE_TILE_LOAD(t, base, stride)                                                          \
  __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm" #t "|tileloadd\t%%tmm" #t ", [%0+%1*1]}" ::"r"( \
                       static_cast<const void*>(base)),                                              \
                   "r"(static_cast<long>(stride))                                                    \
                   : "memory")
#define CASCADE_TILE_STORE(t, base, stride)                                                           \
  __asm__ volatile("{tilestored\t%%tmm" #t ", (%0,%1,1)|tilestored\t[%0+%1*1], %%tmm" #t "}" ::"r"( \
                       static_cast<void*>(base)),                                                      \
                   "r"(static_cast<long>(stride))                                                      \
                   : "memory")
#define CASCADE_TILE_ZERO(t) __asm__ volatile("tilezero\t%%tmm" #t ::)
// c += a b (AT&T operand order: b, a, c)
#define CASCADE_TILE_DPBF16(c, a, b) \
  __asm__ volatile("{tdpbf16ps\t%%tmm" #b ", %%tmm" #a ", %%tmm" #c                      \
                   "|tdpbf16ps\t%%tmm" #c ", %%tmm" #a ", %%tmm" #b "}" ::)

CASCADE_TARGET_AVX512_BF16_BEGIN
namespace cascade::cpu::amx {

using V = avx512::V;
using avx512::exp2_neg;
using avx512::finish_row;
using avx512::kLog2e;
using avx512::RowBlock;
using avx512::RowBlocks;
using avx512::transpose16;

// Keys per K/V tile (copied and transposed once, read by every row block), keys per step of a row block.
inline constexpr int64_t kTileKeys = 128;
inline constexpr int kStep = 32;

// The tile configuration: eight tiles of 16 rows x 64 bytes (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads the configuration for the scope and releases the tiles after it (so the OS need not save them).
class Tiles {
 public:
  Tiles() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    __asm__ volatile("ldtilecfg\t%0" ::"m"(c));
  }
  ~Tiles() { __asm__ volatile("tilerelease" ::: "memory"); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// The online softmax of one row block over one step's 32 keys, lane-wise (lanes: rows), as
// avx512_bf16::tile_block_bf16: s holds S^T (32 x 16 floats, unscaled), p receives P^T as bf16 key pairs
// (16 x 16 words), and m, l and the block's O^T (d, 16) are brought to the step's max.
inline void softmax(const float* s, float qs, int nk, const uint32_t* bits, uint32_t* p, float* ot, int64_t d, float* m,
                    float* l) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf), qsv = _mm512_set1_ps(qs);
  __m512 x[kStep];
  CASCADE_UNROLL(32)
  for (int j = 0; j < kStep; ++j) {
    x[j] = _mm512_mul_ps(_mm512_load_ps(s + j * 16), qsv);
    if (bits) x[j] = j < nk ? V::select(V::mask_from_bits(bits[j]), x[j], neg_inf) : neg_inf;
    else if (j >= nk) x[j] = neg_inf;
  }
  // The max as a tree (a chain of 31 would wait ~120 cycles on the latency of each max in turn).
  __m512 mt[kStep / 2];
  CASCADE_UNROLL(16)
  for (int j = 0; j < kStep / 2; ++j) mt[j] = _mm512_max_ps(x[2 * j], x[2 * j + 1]);
  for (int w = kStep / 4; w >= 1; w /= 2)
    CASCADE_UNROLL(8)
    for (int j = 0; j < w; ++j) mt[j] = _mm512_max_ps(mt[j], mt[j + w]);
  const __m512 mx = mt[0];
  const __m512 m_old = _mm512_loadu_ps(m);
  const __m512 m_new = _mm512_max_ps(m_old, mx);
  const __m512 m_use = V::select(V::eq(m_new, neg_inf), _mm512_setzero_ps(), m_new);
  const bool moved = !V::all_eq(m_new, m_old);
  __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                            6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  CASCADE_UNROLL(16)
  for (int jp = 0; jp < kStep / 2; ++jp) {
    const __m512 e0 = exp2_neg(_mm512_sub_ps(x[2 * jp], m_use));
    const __m512 e1 = exp2_neg(_mm512_sub_ps(x[2 * jp + 1], m_use));
    sums[jp % 4] = _mm512_add_ps(sums[jp % 4], _mm512_add_ps(e0, e1));
    _mm512_store_si512(p + jp * 16, _mm512_permutexvar_epi16(pair_idx, __m512i(_mm512_cvtne2ps_pbh(e1, e0))));
  }
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3]));
  _mm512_storeu_ps(m, m_new);
  const __m512 l_old = _mm512_loadu_ps(l);
  if (moved) {
    const __m512 alpha = exp2_neg(_mm512_sub_ps(m_old, m_use));
    _mm512_storeu_ps(l, _mm512_fmadd_ps(l_old, alpha, sum));
    for (int64_t i = 0; i < d; ++i) _mm512_storeu_ps(ot + i * 16, _mm512_mul_ps(_mm512_loadu_ps(ot + i * 16), alpha));
  } else {
    _mm512_storeu_ps(l, _mm512_add_ps(l_old, sum));
  }
}

// S^T of one row block and 32 keys (kp: their rows, ks elements apart) into s (32 x 16 floats, unscaled), on
// tiles 0-4.
template <int D>
inline void scores(const uint32_t* qp, const uint16_t* kp, int64_t ks, int64_t d_rt, float* s) {
  const int64_t d = D > 0 ? D : d_rt;
  CASCADE_TILE_ZERO(0);
  CASCADE_TILE_ZERO(1);
  for (int64_t c = 0; c < d; c += 32) {
    CASCADE_TILE_LOAD(2, kp + c, ks * 2);
    CASCADE_TILE_LOAD(3, kp + 16 * ks + c, ks * 2);
    CASCADE_TILE_LOAD(4, qp + c / 2 * 16, 64);
    CASCADE_TILE_DPBF16(0, 2, 4);
    CASCADE_TILE_DPBF16(1, 3, 4);
  }
  CASCADE_TILE_STORE(0, s, 64);
  CASCADE_TILE_STORE(1, s + 256, 64);
}

// O^T += V^T P^T for one row block and 32 keys (vt: V^T at the first, rows n_tile bf16 apart), on tiles 2-7.
template <int D>
inline void weighted_values(const uint32_t* p, const uint16_t* vt, int64_t n_tile, int64_t d_rt, float* ot) {
  const int64_t d = D > 0 ? D : d_rt;
  CASCADE_TILE_LOAD(7, p, 64);
  for (int64_t i = 0; i < d; i += 32) {
    CASCADE_TILE_LOAD(5, ot + i * 16, 64);
    CASCADE_TILE_LOAD(6, ot + (i + 16) * 16, 64);
    CASCADE_TILE_LOAD(2, vt + i * n_tile, n_tile * 2);
    CASCADE_TILE_LOAD(3, vt + (i + 16) * n_tile, n_tile * 2);
    CASCADE_TILE_DPBF16(5, 2, 7);
    CASCADE_TILE_DPBF16(6, 3, 7);
    CASCADE_TILE_STORE(5, ot + i * 16, 64);
    CASCADE_TILE_STORE(6, ot + (i + 16) * 16, 64);
  }
}

// One step of a row block: 32 keys of the tile against 16 rows. qp: the block's Q^T, (d/2, 16) words; kp: the
// 32 keys' rows (d bf16 each, ks elements apart: in the KV cache itself, or a padded copy); vt: V^T of the
// tile, d rows of n_tile bf16, at this step's first key; s, p: scratch (32 x 16 floats, 16 x 16 words); ot: the
// block's O^T, (d, 16); m, l: its running max and sum.
template <int D>
inline void step(const uint32_t* qp, const uint16_t* kp, int64_t ks, const uint16_t* vt, int64_t n_tile,
                 int64_t d_rt, float qs, int nk, const uint32_t* bits, float* s, uint32_t* p, float* ot, float* m,
                 float* l) {
  const int64_t d = D > 0 ? D : d_rt;
  scores<D>(qp, kp, ks, d, s);
  softmax(s, qs, nk, bits, p, ot, d, m, l);
  weighted_values<D>(p, vt, n_tile, d, ot);
}

// step for two row blocks at once (32 rows): each K and V^T tile loaded serves both, and the two blocks'
// products are independent (four accumulations in flight instead of two). It gains little over two single steps:
// the vector work and the tile loads and stores, not the multiplies, bound a step (docs/study.md §11, §20). q2,
// o2, m2, l2: the second block's; s and p hold both blocks' (64 x 16 floats, 32 x 16 words).
template <int D>
inline void step2(const uint32_t* qp, const uint32_t* q2, const uint16_t* kp, int64_t ks, const uint16_t* vt,
                  int64_t n_tile, int64_t d_rt, float qs, int nk, const uint32_t* bits, const uint32_t* bits2,
                  float* s, uint32_t* p, float* ot, float* o2, float* m, float* m2, float* l, float* l2) {
  const int64_t d = D > 0 ? D : d_rt;
  CASCADE_TILE_ZERO(0);
  CASCADE_TILE_ZERO(1);
  CASCADE_TILE_ZERO(2);
  CASCADE_TILE_ZERO(3);
  for (int64_t c = 0; c < d; c += 32) {
    CASCADE_TILE_LOAD(4, kp + c, ks * 2);
    CASCADE_TILE_LOAD(5, kp + 16 * ks + c, ks * 2);
    CASCADE_TILE_LOAD(6, qp + c / 2 * 16, 64);
    CASCADE_TILE_LOAD(7, q2 + c / 2 * 16, 64);
    CASCADE_TILE_DPBF16(0, 4, 6);
    CASCADE_TILE_DPBF16(1, 5, 6);
    CASCADE_TILE_DPBF16(2, 4, 7);
    CASCADE_TILE_DPBF16(3, 5, 7);
  }
  CASCADE_TILE_STORE(0, s, 64);
  CASCADE_TILE_STORE(1, s + 256, 64);
  CASCADE_TILE_STORE(2, s + 512, 64);
  CASCADE_TILE_STORE(3, s + 768, 64);
  softmax(s, qs, nk, bits, p, ot, d, m, l);
  softmax(s + 512, qs, nk, bits2, p + 256, o2, d, m2, l2);
  CASCADE_TILE_LOAD(6, p, 64);
  CASCADE_TILE_LOAD(7, p + 256, 64);
  for (int64_t i = 0; i < d; i += 32) {
    CASCADE_TILE_LOAD(0, ot + i * 16, 64);
    CASCADE_TILE_LOAD(1, ot + (i + 16) * 16, 64);
    CASCADE_TILE_LOAD(2, o2 + i * 16, 64);
    CASCADE_TILE_LOAD(3, o2 + (i + 16) * 16, 64);
    CASCADE_TILE_LOAD(4, vt + i * n_tile, n_tile * 2);
    CASCADE_TILE_LOAD(5, vt + (i + 16) * n_tile, n_tile * 2);
    CASCADE_TILE_DPBF16(0, 4, 6);
    CASCADE_TILE_DPBF16(1, 5, 6);
    CASCADE_TILE_DPBF16(2, 4, 7);
    CASCADE_TILE_DPBF16(3, 5, 7);
    CASCADE_TILE_STORE(0, ot + i * 16, 64);
    CASCADE_TILE_STORE(1, ot + (i + 16) * 16, 64);
    CASCADE_TILE_STORE(2, o2 + i * 16, 64);
    CASCADE_TILE_STORE(3, o2 + (i + 16) * 16, 64);
  }
}

// V^T of tokens [a, a + n) of bf16 head kvh: vt row i (kTileKeys bf16) = V(a + j, i) for j < n, zero up to n_pad
// (a multiple of 32). 32 keys x 32 dims at a time: adjacent keys paired into words (dims in two halves), then
// each 16 x 16 block of words transposed.
inline void v_transposed(const KvView& kv, int kvh, int64_t a, int64_t n, int64_t n_pad, int64_t d, uint16_t* vt) {
  const uint16_t* vb = static_cast<const uint16_t*>(kv.v);
  alignas(64) uint32_t lo[16 * 16], hi[16 * 16];
  uint32_t* vw = reinterpret_cast<uint32_t*>(vt);
  for (int64_t j0 = 0; j0 < n_pad; j0 += kStep)
    for (int64_t i = 0; i < d; i += 32) {
      CASCADE_UNROLL(16)
      for (int jp = 0; jp < 16; ++jp) {
        const int64_t j = j0 + 2 * jp;
        const __m512i x = j < n ? _mm512_loadu_si512(vb + kv.offset(a + j, kvh) + i) : _mm512_setzero_si512();
        const __m512i y = j + 1 < n ? _mm512_loadu_si512(vb + kv.offset(a + j + 1, kvh) + i) : _mm512_setzero_si512();
        __m512i wl, wh;
        avx512_bf16::pair_rows(x, y, wl, wh);
        _mm512_store_si512(lo + jp * 16, wl);
        _mm512_store_si512(hi + jp * 16, wh);
      }
      transpose16(lo, 16, vw + i * (kTileKeys / 2) + j0 / 2, kTileKeys / 2);
      transpose16(hi, 16, vw + (i + 16) * (kTileKeys / 2) + j0 / 2, kTileKeys / 2);
    }
}

// The tiled kernel for bf16 K/V (head_dim a multiple of 32) on AMX tiles: row blocks of 16 rows, two at a time
// (step2) and the last one alone when their number is odd, against 32 keys a step; tiles of kTileKeys keys, the
// next one asked for all at once after the load.
template <int D>
struct TiledAmx {
  static constexpr int RB = 16;
  static constexpr int64_t kTileKeys = amx::kTileKeys;
  static constexpr int64_t kTilePad = kTileKeys;
  static constexpr int kMaxSub = 2;
  static constexpr bool kPrefetchSpread = false;
  enum Kind { pair, single };

  static constexpr int kD = D;
  int64_t d;
  float qs = 0;                // scale * log2 e, applied to S
  uint32_t* qp = nullptr;      // Q^T per block of 16 rows: (d/2, 16) words of bf16 head-dim pairs
  uint16_t* kp = nullptr;      // a last step's K rows, zero-padded to 32 keys
  float* s = nullptr;          // S^T of a step (two blocks': 64 x 16 floats)
  uint32_t* p = nullptr;       // P^T of a step (32 x 16 words)
  uint16_t* vt = nullptr;      // V^T of the tile: d rows of kTileKeys bf16
  const uint16_t* k_run = nullptr;  // the tile's K in the cache itself, rows ks apart
  int64_t ks = 0, n_full = 0;       // its row stride; its keys in whole steps of 32
  Tiles tiles;                 // the tile configuration, for the call

  explicit TiledAmx(const KvView& kv) : d(D > 0 ? D : kv.head_dim) {}

  RowBlocks blocks(int64_t n_rows) const {
    const int64_t n_blocks = (n_rows + RB - 1) / RB;
    RowBlocks b({0, 2 * RB, 2, RB, kStep, RB, pair}, n_blocks / 2);
    if (n_blocks % 2) b.add({(n_blocks - 1) * RB, RB, 1, RB, kStep, RB, single});
    return b;
  }

  // Q^T per block: each 16 rows x 32 dims rounded to bf16 (nearest even, as bf16(float)) as 16 x 16 words of dim
  // pairs, transposed to (dim pair, row). Rows past n_rows are zero.
  void begin(const float* q, int64_t n_rows, const RowBlocks& blocks, float scale, Scratch& sc) {
    const int64_t n_blocks = (n_rows + RB - 1) / RB;
    qp = reinterpret_cast<uint32_t*>(sc.get(0, n_blocks * RB * d / 2));
    kp = reinterpret_cast<uint16_t*>(sc.get(4, kStep * d / 2));
    s = sc.get(7, 64 * 16 + 32 * 16 + kTileKeys * d / 2);
    p = reinterpret_cast<uint32_t*>(s + 64 * 16);
    vt = reinterpret_cast<uint16_t*>(s + 64 * 16 + 32 * 16);
    qs = scale * kLog2e;
    alignas(64) uint32_t rows[16 * 16];
    for (int64_t b = 0; b < n_blocks; ++b)
      for (int64_t k = 0; k < d; k += 32) {
        for (int64_t x = 0; x < RB; ++x) {
          const int64_t r = b * RB + x;
          const __m512i w = r < n_rows ? __m512i(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + r * d + k + 16),
                                                                     _mm512_loadu_ps(q + r * d + k)))
                                       : _mm512_setzero_si512();
          _mm512_store_si512(rows + x * 16, w);
        }
        transpose16(rows, 16, qp + (b * d / 2 + k / 2) * RB, RB);
      }
  }

  // K tiles load from the cache itself (a tile's tokens are one run, stride_token apart); only a last step of
  // fewer than 32 keys reads a zero-padded copy, since its tile would read rows past the run. V^T is built once.
  void load_tile(const KvView& kv, int kvh, int64_t a, int64_t n, Scratch&) {
    const int64_t n_pad = (n + kStep - 1) / kStep * kStep;
    k_run = static_cast<const uint16_t*>(kv.k) + kv.offset(a, kvh);
    ks = kv.stride_token;
    n_full = n / kStep * kStep;
    if (n_full < n) {
      for (int64_t j = n_full; j < n; ++j) std::memcpy(kp + (j - n_full) * d, k_run + j * ks, size_t(d) * 2);
      std::memset(kp + (n - n_full) * d, 0, size_t((n_pad - n) * d) * 2);
    }
    v_transposed(kv, kvh, a, n, n_pad, d, vt);
  }

  void step(const RowBlock& b, int64_t c, int nk, const uint32_t* bits, int64_t bits_stride, float* ot, float* m,
            float* l) const {
    const uint16_t* kc = c < n_full ? k_run + c * ks : kp;
    const int64_t kstride = c < n_full ? ks : d;
    const int64_t d = D > 0 ? D : this->d;
    const uint32_t* q0 = qp + b.r0 * d / 2;
    if (b.kind == pair)
      step2<D>(q0, q0 + RB * d / 2, kc, kstride, vt + c, kTileKeys, d, qs, nk, bits,
               bits ? bits + bits_stride : nullptr, s, p, ot, ot + RB * d, m, m + RB, l, l + RB);
    else
      amx::step<D>(q0, kc, kstride, vt + c, kTileKeys, d, qs, nk, bits, s, p, ot, m, l);
  }
};

// The tiled kernel for bf16 K/V on AMX tiles (see run_tiled).
template <int D, class Mask>
void tile_attend(const float* q, int64_t n_rows, const KvView& kv, int kvh, int64_t t0, int64_t t1, const Mask& mask,
                 float scale, float* o, float* lse, Scratch& sc) {
  TiledAmx<D> p(kv);
  avx512_bf16::run_tiled(p, q, n_rows, kv, kvh, t0, t1, mask, scale, o, lse, sc);
}

}  // namespace cascade::cpu::amx
CASCADE_TARGET_END

#endif  // CASCADE_X86 && __x86_64__
