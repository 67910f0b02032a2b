// The AVX-512 kernels (F, BW, VL, DQ; 16 lanes), and the shared-pass kernel on vdpbf16ps for bf16 K/V where
// the CPU has AVX512_BF16. Compiled for those instruction sets whatever the build's flags; the dispatcher
// (kernel.hpp) calls them only where cpu_features() has them.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cascade/cpu/kernel_avx2.hpp"  // its 8-lane vector, for the narrow kernels
#include "cascade/cpu/kernel_common.hpp"

#if CASCADE_X86

CASCADE_TARGET_AVX512_BEGIN
namespace cascade::cpu::avx512 {

struct V {
  using reg = __m512;
  using msk = __mmask16;
  static constexpr int W = 16;
  // n = kExp2Min gives exactly 0 (a masked score, or one 2^-125 below the row's max), and every other result
  // p * 2^n (p in [2^-0.5, 2^0.5], n > kExp2Min) is a normal number. An instruction whose result is subnormal
  // or underflows to 0 takes a microcode assist on Intel cores: with a floor of -160 every masked lane cost one,
  // and the unified baseline ran 1.7x slower on AVX-512 than on AVX2.
  static constexpr float kExp2Min = -126.0f;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg a) { _mm512_storeu_ps(p, a); }
  static reg bcast(const float* p) { return _mm512_set1_ps(*p); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg round(reg x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static reg ldexp(reg p, reg n) {
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(n, _mm512_set1_ps(kExp2Min), _CMP_GT_OQ), p, n);
  }
  static msk eq(reg a, reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static bool all_eq(reg a, reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ) == 0xFFFF; }
  static reg select(msk m, reg if_set, reg if_clear) { return _mm512_mask_blend_ps(m, if_clear, if_set); }
  static msk mask_from_bits(uint32_t bits) { return msk(bits); }
  static float hsum(reg a) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  static float hmax(reg a) {
    const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(a),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  // The horizontal sums of a0..a3 in lanes 0..3: one transposing reduction instead of four.
  static __m128 sum4(reg a0, reg a1, reg a2, reg a3) {
    const reg b0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const reg b1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512d x = _mm512_castps_pd(b0), y = _mm512_castps_pd(b1);
    // each 128-bit block: partial sums of a0, a1, a2, a3 over that block's lanes
    const reg c = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    const reg e = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0x4E));
    return _mm512_castps512_ps128(_mm512_add_ps(e, _mm512_shuffle_f32x4(e, e, 0xB1)));
  }
  template <class T>
  static reg kv(const T* p) {
    if constexpr (std::is_same_v<T, float>) {
      return _mm512_loadu_ps(p);
    } else if constexpr (std::is_same_v<T, f16>) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    } else {
      return _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    }
  }
};

#include "cascade/cpu/kernel_simd.inc"

// The same kernels on 8 lanes (256-bit registers), compiled for AVX-512 so that they have 32 registers, for
// the tiled kernel's last row block when it holds 8 rows or fewer (NarrowTail). 16 lanes would leave half of
// them empty, and a 512-bit instruction costs two 256-bit ones on CPUs that split them (Zen 4): 24 rows (8
// sequences x 3 query heads per KV head) cost 32 rows' work on 16 lanes, 24 rows' with the narrow tail.
namespace narrow {
struct V : avx2::V {};
#include "cascade/cpu/kernel_simd.inc"
}  // namespace narrow

// tile_attend's last row block on 8 lanes.
struct NarrowTail {
  static constexpr int W = narrow::V::W;
  template <int D, int NK>
  static void block(const float* qt, const float* kp, const float* vp, int64_t d, int nk, const uint32_t* bits,
                    int64_t bits_stride, float* ot, float* m, float* l) {
    narrow::tile_block<D, 1, NK>(qt, kp, vp, d, nk, bits, bits_stride, ot, m, l);
  }
};

}  // namespace cascade::cpu::avx512
CASCADE_TARGET_END

// ---- the shared pass on vdpbf16ps --------------------------------------------------------------------------
//
// For bf16 K/V: S = Q K^T and O += P V as bf16 dot products (each instruction 32 multiply-adds of bf16 pairs
// into f32, twice the f32 FMA rate). q is rounded to bf16 (the scale is applied to S in f32 afterwards) and
// the softmax weights are rounded to bf16 for P V, while their sum l stays f32: each weight carries a
// relative error of at most 2^-8, so |o - o_exact| <= 2^-8 sum_j w_j |v_j|; the max and lse are f32.
// Operands pair adjacent elements of the reduction: Q (and K, as stored) pair head dims; P and V pair keys,
// so each V tile is repacked once as (key pair, head dim) words, shared by every row block.
CASCADE_TARGET_AVX512_BF16_BEGIN
namespace cascade::cpu::avx512_bf16 {

using V = avx512::V;
using avx512::exp2_neg;
using avx512::finish_row;
using avx512::kLn2;
using avx512::kLog2e;
using avx512::kTileKeys;
using avx512::kFewTile;

inline __m512i bcast32(const void* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return _mm512_set1_epi32(x);
}

// Two rows x, y of 32 bf16 as key-pair words: lo word i = x_i | y_i << 16 (i < 16), hi word i the same for 16 + i.
inline void pair_rows(__m512i x, __m512i y, __m512i& lo, __m512i& hi) {
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  lo = _mm512_permutex2var_epi16(x, lo_idx, y);
  hi = _mm512_permutex2var_epi16(x, _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16)), y);
}

// Copies tokens [a, a + n) of bf16 head kvh into kp (n_pad rows of d bf16, the rest zero), and the same
// tokens of V as key pairs: vp word (jp, i) = V(2jp, i) | V(2jp + 1, i) << 16.
inline void bf16_panels(const KvView& kv, int kvh, int64_t a, int64_t n, int64_t n_pad, int64_t d, uint16_t* kp,
                        uint32_t* vp) {
  const uint16_t* kb = static_cast<const uint16_t*>(kv.k);
  const uint16_t* vb = static_cast<const uint16_t*>(kv.v);
  for (int64_t j = 0; j < n; ++j) std::memcpy(kp + j * d, kb + kv.offset(a + j, kvh), size_t(d) * 2);
  std::memset(kp + n * d, 0, size_t((n_pad - n) * d) * 2);
  for (int64_t jp = 0; jp < n_pad / 2; ++jp) {
    const int64_t j0 = 2 * jp, j1 = 2 * jp + 1;
    const uint16_t* r0 = j0 < n ? vb + kv.offset(a + j0, kvh) : nullptr;
    const uint16_t* r1 = j1 < n ? vb + kv.offset(a + j1, kvh) : nullptr;
    uint32_t* dst = vp + jp * d;
    int64_t i = 0;
    if (r0 && r1)
      for (; i + 32 <= d; i += 32) {
        __m512i lo, hi;
        pair_rows(_mm512_loadu_si512(r0 + i), _mm512_loadu_si512(r1 + i), lo, hi);
        _mm512_storeu_si512(dst + i, lo);
        _mm512_storeu_si512(dst + i + 16, hi);
      }
    for (; i < d; ++i) dst[i] = uint32_t(r0 ? r0[i] : 0) | uint32_t(r1 ? r1[i] : 0) << 16;
  }
}

// One row block (RV registers of 16 rows) against NK keys: as avx512::tile_block, with bf16 operands.
// qp: (d/2, RV*16) words, the block's q as bf16 head-dim pairs; kp: (NK, d) bf16; vp: (NK/2, d) key-pair words.
// S is scaled by qs (scale * log2 e) before the softmax.
template <int D, int RV, int NK>
inline void tile_block_bf16(const uint32_t* qp, const uint16_t* kp, const uint32_t* vp, int64_t d_rt, float qs,
                            int nk, const uint32_t* bits, int64_t bits_stride, float* ot, float* m, float* l) {
  using reg = __m512;
  constexpr int W = 16;
  static_assert(NK % 2 == 0);
  const int64_t d = D > 0 ? D : d_rt;
  reg s[NK][RV];
  CASCADE_UNROLL(16)
  for (int j = 0; j < NK; ++j)
    CASCADE_UNROLL(4)
    for (int v = 0; v < RV; ++v) s[j][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < d; k += 2) {
    __m512bh qv[RV];
    CASCADE_UNROLL(4)
    for (int v = 0; v < RV; ++v) qv[v] = __m512bh(_mm512_loadu_si512(qp + (k / 2 * RV + v) * W));
    CASCADE_UNROLL(16)
    for (int j = 0; j < NK; ++j) {
      const __m512bh kj = __m512bh(bcast32(kp + j * d + k));
      CASCADE_UNROLL(4)
      for (int v = 0; v < RV; ++v) s[j][v] = _mm512_dpbf16_ps(s[j][v], qv[v], kj);
    }
  }
  const reg neg_inf = _mm512_set1_ps(kNegInf);
  const reg qsv = _mm512_set1_ps(qs);
  CASCADE_UNROLL(16)
  for (int j = 0; j < NK; ++j)
    CASCADE_UNROLL(4)
    for (int v = 0; v < RV; ++v) {
      s[j][v] = _mm512_mul_ps(s[j][v], qsv);
      if (bits) s[j][v] = j < nk ? V::select(V::mask_from_bits(bits[v * bits_stride + j]), s[j][v], neg_inf) : neg_inf;
      else if (j >= nk) s[j][v] = neg_inf;
    }
  reg alpha[RV];
  bool rescale = false;
  __m512bh pp[NK / 2][RV];
  const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                            6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  CASCADE_UNROLL(4)
  for (int v = 0; v < RV; ++v) {
    reg mx = s[0][v];
    CASCADE_UNROLL(16)
    for (int j = 1; j < NK; ++j) mx = _mm512_max_ps(mx, s[j][v]);
    const reg m_old = _mm512_loadu_ps(m + v * W);
    const reg m_new = _mm512_max_ps(m_old, mx);
    const reg m_use = V::select(V::eq(m_new, neg_inf), _mm512_setzero_ps(), m_new);
    const bool moved = !V::all_eq(m_new, m_old);
    rescale |= moved;
    alpha[v] = exp2_neg(_mm512_sub_ps(m_old, m_use));
    reg sum = _mm512_setzero_ps();
    CASCADE_UNROLL(16)
    for (int j = 0; j < NK; ++j) {
      s[j][v] = exp2_neg(_mm512_sub_ps(s[j][v], m_use));
      sum = _mm512_add_ps(sum, s[j][v]);
    }
    _mm512_storeu_ps(m + v * W, m_new);
    const reg l_old = _mm512_loadu_ps(l + v * W);
    _mm512_storeu_ps(l + v * W, moved ? _mm512_fmadd_ps(l_old, alpha[v], sum) : _mm512_add_ps(l_old, sum));
    CASCADE_UNROLL(8)
    for (int jp = 0; jp < NK / 2; ++jp)
      pp[jp][v] = __m512bh(
          _mm512_permutexvar_epi16(pair_idx, __m512i(_mm512_cvtne2ps_pbh(s[2 * jp + 1][v], s[2 * jp][v]))));
  }
  constexpr int KU = 4;
  int64_t k = 0;
  for (; k + KU <= d; k += KU) {
    reg acc[KU][RV];
    CASCADE_UNROLL(4)
    for (int u = 0; u < KU; ++u)
      CASCADE_UNROLL(4)
      for (int v = 0; v < RV; ++v) {
        acc[u][v] = _mm512_loadu_ps(ot + ((k + u) * RV + v) * W);
        if (rescale) acc[u][v] = _mm512_mul_ps(acc[u][v], alpha[v]);
      }
    CASCADE_UNROLL(8)
    for (int jp = 0; jp < NK / 2; ++jp)
      CASCADE_UNROLL(4)
      for (int u = 0; u < KU; ++u) {
        const __m512bh vj = __m512bh(bcast32(vp + jp * d + k + u));
        CASCADE_UNROLL(4)
        for (int v = 0; v < RV; ++v) acc[u][v] = _mm512_dpbf16_ps(acc[u][v], pp[jp][v], vj);
      }
    CASCADE_UNROLL(4)
    for (int u = 0; u < KU; ++u)
      CASCADE_UNROLL(4)
      for (int v = 0; v < RV; ++v) _mm512_storeu_ps(ot + ((k + u) * RV + v) * W, acc[u][v]);
  }
  if constexpr (D == 0 || D % KU != 0) {  // head dims that are not a multiple of KU
    for (; k < d; ++k) {
      CASCADE_UNROLL(4)
      for (int v = 0; v < RV; ++v) {
        reg acc = _mm512_loadu_ps(ot + (k * RV + v) * W);
        if (rescale) acc = _mm512_mul_ps(acc, alpha[v]);
        CASCADE_UNROLL(8)
        for (int jp = 0; jp < NK / 2; ++jp)
          acc = _mm512_dpbf16_ps(acc, pp[jp][v], __m512bh(bcast32(vp + jp * d + k)));
        _mm512_storeu_ps(ot + (k * RV + v) * W, acc);
      }
    }
  }
}

// As avx512::tile_attend for bf16 K/V (head_dim even), on bf16 dot products.
template <int D, int RV, int NK, class Mask>
void tile_attend(const float* q, int64_t n_rows, const KvView& kv, int kvh, int64_t t0, int64_t t1, const Mask& mask,
                 float scale, float* o, float* lse, Scratch& sc) {
  constexpr int W = 16;
  constexpr int64_t RB = int64_t(RV) * W;
  const int64_t d = D > 0 ? D : kv.head_dim;
  const int64_t n_blocks = (n_rows + RB - 1) / RB;
  const int64_t n_tile = (kTileKeys + NK - 1) / NK * NK;
  uint32_t* qp = reinterpret_cast<uint32_t*>(sc.get(0, n_blocks * RB * d / 2));
  float* ot = sc.get(1, n_blocks * RB * d);
  float* m = sc.get(2, n_blocks * RB);
  float* l = sc.get(3, n_blocks * RB);
  uint16_t* kp = reinterpret_cast<uint16_t*>(sc.get(4, n_tile * d / 2));
  uint32_t* vp = reinterpret_cast<uint32_t*>(sc.get(5, n_tile * d / 2));
  uint32_t* bits = reinterpret_cast<uint32_t*>(sc.get(6, n_tile * RV));
  // q rounded to bf16 (nearest even), head dims in pairs, lanes past n_rows zero; row by row, each query row
  // read once in order (tile_attend's transpose).
  std::fill(qp, qp + n_blocks * RB * d / 2, 0u);
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* __restrict qr = q + r * d;
    uint32_t* __restrict dst = qp + (r / RB) * RB * d / 2 + r % RB;
    for (int64_t k = 0; k < d; k += 2) {
      const uint32_t lo = Eigen::numext::bit_cast<uint16_t>(bf16(qr[k]));
      const uint32_t hi = Eigen::numext::bit_cast<uint16_t>(bf16(qr[k + 1]));
      dst[k / 2 * RB] = lo | hi << 16;
    }
  }
  std::fill(ot, ot + n_blocks * RB * d, 0.0f);
  std::fill(m, m + n_blocks * RB, kNegInf);
  std::fill(l, l + n_blocks * RB, 0.0f);
  const float qs = scale * kLog2e;
  for (int64_t a = t0; a < t1;) {
    const int64_t n = std::min({kTileKeys, t1 - a, kv.run_length(a)});
    const int64_t n_pad = (n + NK - 1) / NK * NK;
    bf16_panels(kv, kvh, a, n, n_pad, d, kp, vp);
    // the next tile asked for a share per step (TilePrefetch), over the steps of every row block
    avx512::TilePrefetch pf;
    pf.start(kv, kvh, a + n, std::min(t1, a + n + kTileKeys), n_blocks * (n_pad / NK));
    for (int64_t b = 0; b < n_blocks; ++b) {
      const int64_t r0 = b * RB, rows = std::min(RB, n_rows - r0);
      const bool full = mask.all_visible(r0, rows, a, n);
      if (!full)
        for (int v = 0; v < RV; ++v) {
          const int64_t lanes = std::clamp<int64_t>(rows - v * W, 0, W);
          if (lanes > 0) mask.lane_bits(r0 + v * W, int(lanes), a, n, bits + v * n_tile);
          else std::fill(bits + v * n_tile, bits + v * n_tile + n, 0u);
        }
      for (int64_t c = 0; c < n; c += NK) {
        pf.step();
        const int nk = int(std::min<int64_t>(NK, n - c));
        tile_block_bf16<D, RV, NK>(qp + b * RB * d / 2, kp + c * d, vp + c / 2 * d, d, qs, nk,
                                   full ? nullptr : bits + c, n_tile, ot + b * RB * d, m + r0, l + r0);
      }
    }
    a += n;
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t b = r / RB, x = r % RB;
    finish_row(ot + b * RB * d + x, RB, m[r], l[r], d, o + r * d, lse + r);
  }
}

// ---- the per-sequence pass on vdpbf16ps ----------------------------------------------------------------------
//
// avx512::few_attend for bf16 K/V (head dim a multiple of 32) on bf16 dot products, with tile_attend's rounding
// above: q rounded to bf16 (S scaled in f32 afterwards), the softmax weights rounded to bf16 for P V while their
// sum l stays f32. K as stored pairs head dims; for P V the rows of two keys are interleaved word by word in
// registers (vpunpck{l,h}wd), so an accumulator row holds each 32-dim block's dims in the order those give
// (few_pair_dim), put back in order once at the end. Nothing is converted to f32: per key and row the products
// take half the instructions of the f32 kernel, with no conversions beside them (on Zen 4 a 512-bit
// f16-to-f32 conversion takes two cycles: the f32 kernel spent about as long converting K/V as multiplying).

// The head dim held by lane i (< 32) of a 32-dim block of a P V accumulator: lanes 0-15 come from vpunpcklwd,
// 16-31 from vpunpckhwd, and in each, lane 4 L + t holds word t (or 4 + t) of the block's 128-bit lane L.
constexpr int64_t few_pair_dim(int64_t i) { return (i & 15) / 4 * 8 + (i >= 16 ? 4 : 0) + i % 4; }

// Rows per pass of the score loop (R * 4 accumulators), and 32-dim blocks per pass of the P V loop for R rows
// and NB blocks (0: known at run time, one at a time): as many as fit 24 accumulators, with two key pairs in
// flight (few_bf16_u) when that leaves fewer than 8 chains.
inline constexpr int kFewBf16RowGroup = 4;
inline constexpr int few_bf16_cb(int NB, int R) {
  if (NB <= 0) return 1;
  int cb = NB;
  while (cb > 1 && (2 * R * cb > 24 || NB % cb != 0)) --cb;
  return cb;
}
inline constexpr int few_bf16_u(int NB, int R) { return 2 * R * few_bf16_cb(NB, R) < 8 ? 2 : 1; }

// s(r, j) = qs * (q_r . k_j) for R rows and keys j < n (<= kFewTile) of one head: four keys a step share one
// transposing reduction. qp: (R, d / 2) bf16 head-dim pairs; s: (R, kFewTile). pf, when given, is stepped once per
// key group (few_bf16_score_steps).
template <int NB, int R>
inline void few_scores_bf16(const uint32_t* qp, const uint16_t* kt, int64_t stride, int64_t n, int64_t nb_rt,
                            float qs, float* s, avx512::FewPrefetch* pf_in) {
  avx512::FewPrefetch pf_local;  // in registers over the loop, not through the pointer
  avx512::FewPrefetch* pf = pf_in ? &pf_local : nullptr;
  if (pf_in) pf_local = *pf_in;
  const int64_t nb = NB > 0 ? NB : nb_rt;
  const int64_t dw = nb * 16;  // q words per row
  const __m128 qs4 = _mm_set1_ps(qs);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    if (pf) pf->step();
    __m512 acc[R][4];
    CASCADE_UNROLL(4)
    for (int r = 0; r < R; ++r)
      CASCADE_UNROLL(4)
      for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_ps();
    CASCADE_UNROLL(4)
    for (int64_t c = 0; c < nb; ++c) {
      __m512bh k[4];
      CASCADE_UNROLL(4)
      for (int u = 0; u < 4; ++u) k[u] = __m512bh(_mm512_loadu_si512(kt + (j + u) * stride + c * 32));
      CASCADE_UNROLL(4)
      for (int r = 0; r < R; ++r) {
        const __m512bh qv = __m512bh(_mm512_loadu_si512(qp + r * dw + c * 16));
        CASCADE_UNROLL(4)
        for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], qv, k[u]);
      }
    }
    CASCADE_UNROLL(4)
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(s + r * kFewTile + j, _mm_mul_ps(V::sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), qs4));
  }
  if (pf && j < n) pf->step();
  for (; j < n; ++j)
    for (int r = 0; r < R; ++r) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < nb; ++c)
        acc = _mm512_dpbf16_ps(acc, __m512bh(_mm512_loadu_si512(qp + r * dw + c * 16)),
                               __m512bh(_mm512_loadu_si512(kt + j * stride + c * 32)));
      s[r * kFewTile + j] = V::hsum(acc) * qs;
    }
  if (pf_in) *pf_in = pf_local;
}

// The step() calls of few_scores_bf16 over n keys (its first row group's).
inline constexpr int64_t few_bf16_score_steps(int64_t n) { return (n + 3) / 4; }

// acc(r, :) += sum_j p(r, j) v_j for R rows, CB 32-dim blocks a pass, U key pairs in flight. pp: (R, kFewTile / 2)
// key-pair words of bf16 weights (zero past key n); acc: (R, d) in few_pair_dim order. pf is stepped once per
// key pair of each pass (few_bf16_pv_steps).
template <int R, int CB, int U>
inline void few_pv_bf16_rows(const uint32_t* pp, const uint16_t* vt, int64_t stride, int64_t n, int64_t nb,
                             float* acc, int64_t d, avx512::FewPrefetch* pf_in) {
  avx512::FewPrefetch pf_local;
  avx512::FewPrefetch* pf = pf_in ? &pf_local : nullptr;
  if (pf_in) pf_local = *pf_in;
  constexpr int64_t PS = kFewTile / 2;  // words per row of pp
  for (int64_t c0 = 0; c0 < nb; c0 += CB) {
    __m512 a[U][R][CB][2];
    CASCADE_UNROLL(2)
    for (int u = 0; u < U; ++u)
      CASCADE_UNROLL(8)
      for (int r = 0; r < R; ++r)
        CASCADE_UNROLL(4)
        for (int c = 0; c < CB; ++c)
          CASCADE_UNROLL(2)
          for (int h = 0; h < 2; ++h)
            a[u][r][c][h] = u == 0 ? _mm512_loadu_ps(acc + r * d + (c0 + c) * 32 + h * 16) : _mm512_setzero_ps();
    // keys j and j + 1 (y1: whether j + 1 < n; its weight is 0 otherwise, and its row is read as zeros)
    auto pair = [&](int u, int64_t j, bool y1) {
      __m512bh w[R];
      CASCADE_UNROLL(8)
      for (int r = 0; r < R; ++r) w[r] = __m512bh(_mm512_set1_epi32(int32_t(pp[r * PS + j / 2])));
      CASCADE_UNROLL(4)
      for (int c = 0; c < CB; ++c) {
        const int64_t at = (c0 + c) * 32;
        const __m512i x = _mm512_loadu_si512(vt + j * stride + at);
        const __m512i y = y1 ? _mm512_loadu_si512(vt + (j + 1) * stride + at) : _mm512_setzero_si512();
        const __m512bh lo = __m512bh(_mm512_unpacklo_epi16(x, y)), hi = __m512bh(_mm512_unpackhi_epi16(x, y));
        CASCADE_UNROLL(8)
        for (int r = 0; r < R; ++r) {
          a[u][r][c][0] = _mm512_dpbf16_ps(a[u][r][c][0], w[r], lo);
          a[u][r][c][1] = _mm512_dpbf16_ps(a[u][r][c][1], w[r], hi);
        }
      }
    };
    int64_t j = 0;
    for (; j + 2 * U <= n; j += 2 * U)
      CASCADE_UNROLL(2)
      for (int u = 0; u < U; ++u) {
        if (pf) pf->step();
        pair(u, j + 2 * u, true);
      }
    for (; j < n; j += 2) {
      if (pf) pf->step();
      pair(0, j, j + 1 < n);
    }
    CASCADE_UNROLL(8)
    for (int r = 0; r < R; ++r)
      CASCADE_UNROLL(4)
      for (int c = 0; c < CB; ++c)
        CASCADE_UNROLL(2)
        for (int h = 0; h < 2; ++h) {
          __m512 sum = a[0][r][c][h];
          CASCADE_UNROLL(2)
          for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, a[u][r][c][h]);
          _mm512_storeu_ps(acc + r * d + (c0 + c) * 32 + h * 16, sum);
        }
  }
  if (pf_in) *pf_in = pf_local;
}

// The step() calls of few_pv_bf16 for n_rows rows, NB blocks (nb at run time) over n keys.
inline constexpr int64_t few_bf16_pv_steps(int NB, int64_t nb, int64_t n_rows, int64_t n) {
  const int r = int(std::min<int64_t>(n_rows, kFewRows));
  const int64_t passes = NB > 0 ? NB / few_bf16_cb(NB, r) : nb;
  return passes * ((n + 1) / 2);
}

template <int NB>
inline void few_pv_bf16(const uint32_t* pp, int64_t n_rows, const uint16_t* vt, int64_t stride, int64_t n, int64_t nb,
                        float* acc, int64_t d, avx512::FewPrefetch* pf) {
  switch (n_rows) {
#define CASCADE_FEW_PV_BF16_CASE(R)                                                                              \
  case R:                                                                                                         \
    return few_pv_bf16_rows<R, few_bf16_cb(NB, R), few_bf16_u(NB, R)>(pp, vt, stride, n, nb, acc, d, pf);
    CASCADE_FEW_PV_BF16_CASE(1)
    CASCADE_FEW_PV_BF16_CASE(2)
    CASCADE_FEW_PV_BF16_CASE(3)
    CASCADE_FEW_PV_BF16_CASE(4)
    CASCADE_FEW_PV_BF16_CASE(5)
    CASCADE_FEW_PV_BF16_CASE(6)
    CASCADE_FEW_PV_BF16_CASE(7)
#undef CASCADE_FEW_PV_BF16_CASE
    default: return few_pv_bf16_rows<8, few_bf16_cb(NB, 8), few_bf16_u(NB, 8)>(pp, vt, stride, n, nb, acc, d, pf);
  }
}

// Heads [kvh, kvh + n_heads) together, tile by tile, as avx512::few_attend (same arguments, the same prefetches);
// head_dim is NB * 32 (NB = 0: known at run time, a multiple of 32).
template <int NB, class Mask>
void few_attend(const float* q, int64_t n_rows, int n_heads, const KvView& kv, int kvh, int64_t t0, int64_t t1,
                const Mask& mask, float scale, float* o, float* lse, Scratch& sc) {
  constexpr int64_t KC = avx512::kFewChunk, SH = kFewRows * kFewTile;
  const int64_t d = kv.head_dim;
  const int64_t nb = NB > 0 ? NB : d / 32;
  const int64_t n_state = n_rows * n_heads;
  uint32_t* qp = reinterpret_cast<uint32_t*>(sc.get(0, n_state * d / 2));
  float* A = sc.get(1, n_state * d);
  float* m = sc.get(2, n_state);
  float* l = sc.get(3, n_state);
  float* s = sc.get(4, n_heads * SH);
  uint32_t* pp = reinterpret_cast<uint32_t*>(sc.get(5, SH / 2));
  float* row = sc.get(6, d);
  // q rounded to bf16 (nearest even), head dims in pairs: 16 pairs per 32 floats
  for (int64_t i = 0; i < n_state * d; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp + i / 2), __m256i(_mm512_cvtneps_pbh(_mm512_loadu_ps(q + i))));
  std::fill(A, A + n_state * d, 0.0f);
  std::fill(m, m + n_state, kNegInf);
  std::fill(l, l + n_state, 0.0f);
  const float qs = scale * kLog2e;
  const uint16_t* kb = static_cast<const uint16_t*>(kv.k);
  const uint16_t* vb = static_cast<const uint16_t*>(kv.v);
  avx512::FewPrefetch pf;
  pf.to_l1 = prefetch_to_l1();
  pf.stride = kv.stride_token * 2;
  pf.bytes = ((n_heads - 1) * kv.stride_head + d) * 2;
  auto bytes_at = [](const uint16_t* p) { return reinterpret_cast<const char*>(p); };
  auto tile_keys = [&](int64_t a) { return std::min({kFewTile, t1 - a, kv.run_length(a)}); };
  const int64_t n_groups = (n_rows + kFewBf16RowGroup - 1) / kFewBf16RowGroup;
  for (int64_t a = t0; a < t1;) {
    const int64_t n = tile_keys(a);
    int64_t score_steps = 0;  // the first row group's, per chunk
    for (int64_t j0 = 0; j0 < n; j0 += KC) score_steps += few_bf16_score_steps(std::min(KC, n - j0));
    const int64_t steps = n_heads * (score_steps + few_bf16_pv_steps(NB, nb, n_rows, n));
    if (a + n < t1)
      pf.start(bytes_at(kb + kv.offset(a + n, kvh)), bytes_at(vb + kv.offset(a + n, kvh)), tile_keys(a + n), steps);
    else
      pf.start_next(sc.next, steps);  // the last tile: the start of what this thread attends next
    for (int64_t j0 = 0; j0 < n; j0 += KC)
      for (int h = 0; h < n_heads; ++h)
        for (int64_t g = 0; g < n_groups; ++g) {
          const int64_t r0 = g * kFewBf16RowGroup;
          const uint32_t* qh = qp + (h * n_rows + r0) * d / 2;
          const uint16_t* kt = kb + kv.offset(a + j0, kvh + h);
          const int64_t nk = std::min(KC, n - j0);
          float* sh = s + h * SH + r0 * kFewTile + j0;
          avx512::FewPrefetch* p = g == 0 ? &pf : nullptr;  // the first row group's loop carries the prefetches
          switch (std::min<int64_t>(kFewBf16RowGroup, n_rows - r0)) {
            case 1: few_scores_bf16<NB, 1>(qh, kt, kv.stride_token, nk, nb, qs, sh, p); break;
            case 2: few_scores_bf16<NB, 2>(qh, kt, kv.stride_token, nk, nb, qs, sh, p); break;
            case 3: few_scores_bf16<NB, 3>(qh, kt, kv.stride_token, nk, nb, qs, sh, p); break;
            default: few_scores_bf16<NB, 4>(qh, kt, kv.stride_token, nk, nb, qs, sh, p); break;
          }
        }
    const bool full = mask.all_visible(0, n_rows, a, n);
    for (int h = 0; h < n_heads; ++h) {
      float* sh = s + h * SH;
      float* Ah = A + h * n_rows * d;
      if (!full) avx512::few_mask(sh, n_rows, a, n, mask);
      avx512::few_softmax(sh, n_rows, n, m + h * n_rows, l + h * n_rows, Ah, d);
      // the weights as bf16 key pairs, zero past key n (a row that sees nothing yet holds -inf there)
      uint16_t* pw = reinterpret_cast<uint16_t*>(pp);
      for (int64_t r = 0; r < n_rows; ++r)
        for (int64_t j = 0; j < n; j += 16) {
          const __mmask16 live = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
          const __m512 p = _mm512_maskz_loadu_ps(live, sh + r * kFewTile + j);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + r * kFewTile + j), __m256i(_mm512_cvtneps_pbh(p)));
        }
      few_pv_bf16<NB>(pp, n_rows, vb + kv.offset(a, kvh + h), kv.stride_token, n, nb, Ah, d, &pf);
    }
    pf.finish();
    a += n;
  }
  for (int64_t r = 0; r < n_state; ++r) {
    const float* ar = A + r * d;
    for (int64_t c = 0; c < d; c += 32)
      for (int64_t i = 0; i < 32; ++i) row[c + few_pair_dim(i)] = ar[c + i];
    finish_row(row, 1, m[r], l[r], d, o + r * d, lse + r);
  }
}

// Multiply-adds per second of vdpbf16ps over those of 512-bit f32 FMAs on the calling core: each instruction
// stream timed over 12 independent chains of 2,048 steps (~30 us), best of three, the two kinds alternating. It
// differs by CPU: about 2x on some (the bf16 products then double the shared pass's rate), 0.5x on others
// (vdpbf16ps at a quarter of the FMA's instruction rate), where they would halve it.
inline double bf16_over_fma_rate() {
  constexpr int kChains = 12;
  constexpr long kSteps = 2048;
  const auto now = [] { return std::chrono::steady_clock::now(); };
  float sink = 0;
  double best_fma = 0, best_bf16 = 0;
  for (int rep = 0; rep < 3; ++rep) {
    __m512 acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(1e-3f * float(c + 1));
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
    auto t0 = now();
    for (long i = 0; i < kSteps; ++i) {
      CASCADE_UNROLL(12)
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
    }
    const double fma_s = std::chrono::duration<double>(now() - t0).count();
    for (int c = 0; c < kChains; ++c) sink += _mm512_cvtss_f32(acc[c]);
    const __m512bh x = __m512bh(_mm512_set1_epi16(0x3f80)), y = __m512bh(_mm512_set1_epi16(0x3800));  // 1, 2^-15
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(1e-3f * float(c + 1));
    t0 = now();
    for (long i = 0; i < kSteps; ++i) {
      CASCADE_UNROLL(12)
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], x, y);
    }
    const double bf16_s = std::chrono::duration<double>(now() - t0).count();
    for (int c = 0; c < kChains; ++c) sink += _mm512_cvtss_f32(acc[c]);
    // multiply-adds per second: 16 per FMA, 32 per vdpbf16ps
    if (fma_s > 0) best_fma = std::max(best_fma, 16.0 * kChains * kSteps / fma_s);
    if (bf16_s > 0) best_bf16 = std::max(best_bf16, 32.0 * kChains * kSteps / bf16_s);
  }
  volatile float keep = sink;  // the loops' results are used
  (void)keep;
  return best_fma > 0 ? best_bf16 / best_fma : 0.0;
}

}  // namespace cascade::cpu::avx512_bf16
CASCADE_TARGET_END

#include "cascade/cpu/kernel_amx.hpp"  // the shared pass on AMX tiles, after the vdpbf16ps kernel it builds on

// ---- entry point ---------------------------------------------------------------------------------------------
CASCADE_TARGET_AVX512_BEGIN
namespace cascade::cpu::avx512 {

// Row blocks of the tiled kernel: RV registers of 16 rows against NK keys (S in registers: RV * NK of 32). Two
// registers share each broadcast key element: with one, the S product's loads (a broadcast per multiply-add)
// kept pace with the two FMA ports and no more.
inline constexpr int kTileRV = 2, kTileNK = 8;

// One head with the tiled kernel: bf16 K/V as `bk` says (AMX tiles for head dims that are a multiple of 32, else
// bf16 dot products, or f32), every other type on f32 multiply-adds with a narrow last block.
template <class T, int D, class Mask>
void tile_head(Bf16Kernel bk, const float* q, int64_t n_rows, const KvView& kv, int kvh, int64_t t0, int64_t t1,
               const Mask& mask, float scale, float* o, float* lse, Scratch& sc) {
  if constexpr (std::is_same_v<T, bf16>) {
#if defined(CASCADE_AMX_KERNEL)
    if (bk == Bf16Kernel::tiles && kv.head_dim % 32 == 0)
      return amx::tile_attend<D, Mask>(q, n_rows, kv, kvh, t0, t1, mask, scale, o, lse, sc);
#endif
    if (bk != Bf16Kernel::f32)
      return avx512_bf16::tile_attend<D, kTileRV, kTileNK, Mask>(q, n_rows, kv, kvh, t0, t1, mask, scale, o, lse, sc);
  }
  tile_attend<T, D, kTileRV, kTileNK, Mask, NarrowTail>(q, n_rows, kv, kvh, t0, t1, mask, scale, o, lse, sc);
}

template <class T, class Mask>
void attend_typed(bool few, const float* q, int64_t n_rows, int n_heads, const KvView& kv, int kvh, int64_t t0,
                  int64_t t1, const Mask& mask, float scale, Bf16Kernel bk, float* o, float* lse, Scratch& sc) {
  const int64_t d = kv.head_dim;
  if (few) {
    if constexpr (std::is_same_v<T, bf16>) {
      if (bk == Bf16Kernel::dot && cpu_features().avx512_bf16 && d % 32 == 0) {
        namespace b = avx512_bf16;
        switch (d) {
          case 64: return b::few_attend<2, Mask>(q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
          case 128: return b::few_attend<4, Mask>(q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
          default: return b::few_attend<0, Mask>(q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
        }
      }
    }
    switch (d) {
      case 64: return few_attend<T, 4, Mask>(q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
      case 128: return few_attend<T, 8, Mask>(q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
      default: return few_attend<T, 0, Mask>(q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
    }
  }
  if (!cpu_features().avx512_bf16 || d % 2 != 0) bk = Bf16Kernel::f32;
  for (int h = 0; h < n_heads; ++h) {
    const float* qh = q + h * n_rows * d;
    float* oh = o + h * n_rows * d;
    float* lh = lse + h * n_rows;
    switch (d) {
      case 64: tile_head<T, 64>(bk, qh, n_rows, kv, kvh + h, t0, t1, mask, scale, oh, lh, sc); break;
      case 128: tile_head<T, 128>(bk, qh, n_rows, kv, kvh + h, t0, t1, mask, scale, oh, lh, sc); break;
      default: tile_head<T, 0>(bk, qh, n_rows, kv, kvh + h, t0, t1, mask, scale, oh, lh, sc); break;
    }
  }
}

// Attends heads [kvh, kvh + n_heads) (q, o: (n_heads, n_rows, head_dim), q times `scale`; lse:
// (n_heads, n_rows)) with the few-rows kernel (head_dim a multiple of 16) or head by head with the tiled one.
template <class Mask>
void attend(bool few, const float* q, int64_t n_rows, int n_heads, const KvView& kv, int kvh, int64_t t0, int64_t t1,
            const Mask& mask, float scale, Bf16Kernel bk, float* o, float* lse, Scratch& sc) {
  const Bf16Kernel b = bk;
  switch (kv.dtype) {
    case DType::f32: return attend_typed<float>(few, q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, b, o, lse, sc);
    case DType::f16: return attend_typed<f16>(few, q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, b, o, lse, sc);
    case DType::bf16: return attend_typed<bf16>(few, q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, b, o, lse, sc);
  }
}

}  // namespace cascade::cpu::avx512
CASCADE_TARGET_END

#endif  // CASCADE_X86
