// The products policies on vdpbf16ps (AVX512_BF16) for bf16 K/V, one per kernel shape (kernel_driver.inc), and
// the rate check that says whether they pay on this CPU. Compiled for AVX512_BF16 whatever the build's flags; the
// plan chooses them (kernel.hpp: choose_kernel) only where cpu_features() has it.
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cascade/cpu/kernel_avx512.hpp"

#if CASCADE_X86

// ---- the shared pass on vdpbf16ps -------------------------------------------------------------------------
//
// For bf16 K/V: S = Q K^T and O += P V as bf16 dot products (each instruction 32 multiply-adds of bf16 pairs
// into f32, twice the f32 FMA rate on some CPUs). q is rounded to bf16 (the scale is applied to S in f32
// afterwards) and the softmax weights are rounded to bf16 for P V, while their sum l stays f32: each weight
// carries a relative error of at most 2^-8, so |o - o_exact| <= 2^-8 sum_j w_j |v_j|; the max and lse are f32.
// Operands pair adjacent elements of the reduction: Q (and K, as stored) pair head dims; P and V pair keys,
// so each V tile is repacked once as (key pair, head dim) words, shared by every row block.
CASCADE_TARGET_AVX512_BF16_BEGIN
namespace cascade::cpu::avx512_bf16 {

// The drivers, compiled here for the bf16 policies (kernel_driver.inc), on the AVX-512 tier's vector pieces.
#include "cascade/cpu/kernel_driver_avx512.inc"

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

// Tokens [a, a + n) of bf16 head kvh of V as key pairs, n_pad keys (the rest zero): vp word (jp, i) =
// V(2jp, i) | V(2jp + 1, i) << 16.
inline void bf16_v_pairs(const KvView& kv, int kvh, int64_t a, int64_t n, int64_t n_pad, int64_t d, uint32_t* vp) {
  const uint16_t* vb = static_cast<const uint16_t*>(kv.v);
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

// Copies tokens [a, a + n) of bf16 head kvh into kp (n_pad rows of d bf16, the rest zero), and the same
// tokens of V as key pairs into vp (bf16_v_pairs).
inline void bf16_panels(const KvView& kv, int kvh, int64_t a, int64_t n, int64_t n_pad, int64_t d, uint16_t* kp,
                        uint32_t* vp) {
  const uint16_t* kb = static_cast<const uint16_t*>(kv.k);
  for (int64_t j = 0; j < n; ++j) std::memcpy(kp + j * d, kb + kv.offset(a + j, kvh), size_t(d) * 2);
  std::memset(kp + n * d, 0, size_t((n_pad - n) * d) * 2);
  bf16_v_pairs(kv, kvh, a, n, n_pad, d, vp);
}

// S = Q K^T of one row block (RV registers of 16 rows) against NK keys, unscaled: s[j][v] holds key j's scores
// of register v's rows. qp: (d/2, RV*16) words, the block's q as bf16 head-dim pairs; kp: (NK, d) bf16.
template <int D, int RV, int NK>
CASCADE_ALWAYS_INLINE void scores_bf16(const uint32_t* qp, const uint16_t* kp, int64_t d, __m512 (&s)[NK][RV]) {
  constexpr int W = 16;
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
}

// S scaled by qs (scale * log2 e) and masked (bits, as avx512::tile_block's; keys past nk never seen), the online
// softmax's update of m and l, and the weights as bf16 key pairs pp[jp][v] for P V. alpha[v]: register v's
// rescale of O; returns whether any lane's max moved.
template <int RV, int NK>
CASCADE_ALWAYS_INLINE bool softmax_bf16(__m512 (&s)[NK][RV], float qs, int nk, const uint32_t* bits,
                                        int64_t bits_stride, float* m, float* l, __m512 (&alpha)[RV],
                                        __m512bh (&pp)[NK / 2][RV]) {
  using reg = __m512;
  constexpr int W = 16;
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
  bool rescale = false;
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
  return rescale;
}

// O = alpha O + P V for one row block, four head dims at a time so that the accumulations are independent chains.
// vp: (NK/2, d) key-pair words; ot: (d, RV*16).
template <int D, int RV, int NK>
CASCADE_ALWAYS_INLINE void pv_bf16(const __m512bh (&pp)[NK / 2][RV], const uint32_t* vp, int64_t d, bool rescale,
                                   const __m512 (&alpha)[RV], float* ot) {
  constexpr int W = 16, KU = 4;
  int64_t k = 0;
  for (; k + KU <= d; k += KU) {
    __m512 acc[KU][RV];
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
        __m512 acc = _mm512_loadu_ps(ot + (k * RV + v) * W);
        if (rescale) acc = _mm512_mul_ps(acc, alpha[v]);
        CASCADE_UNROLL(8)
        for (int jp = 0; jp < NK / 2; ++jp)
          acc = _mm512_dpbf16_ps(acc, pp[jp][v], __m512bh(bcast32(vp + jp * d + k)));
        _mm512_storeu_ps(ot + (k * RV + v) * W, acc);
      }
    }
  }
}

// One row block (RV registers of 16 rows) against NK keys: as avx512::tile_block, with bf16 operands.
// qp: (d/2, RV*16) words; kp: (NK, d) bf16; vp: (NK/2, d) key-pair words. S is scaled by qs before the softmax.
template <int D, int RV, int NK>
inline void tile_block_bf16(const uint32_t* qp, const uint16_t* kp, const uint32_t* vp, int64_t d_rt, float qs,
                            int nk, const uint32_t* bits, int64_t bits_stride, float* ot, float* m, float* l) {
  static_assert(NK % 2 == 0);
  const int64_t d = D > 0 ? D : d_rt;
  __m512 s[NK][RV], alpha[RV];
  __m512bh pp[NK / 2][RV];
  scores_bf16<D, RV, NK>(qp, kp, d, s);
  const bool rescale = softmax_bf16<RV, NK>(s, qs, nk, bits, bits_stride, m, l, alpha, pp);
  pv_bf16<D, RV, NK>(pp, vp, d, rescale, alpha, ot);
}

// The tiled kernel for bf16 K/V (head_dim even) on bf16 dot products: row blocks of RV registers of 16 rows (the
// last one padded) against NK keys a step.
template <int D, int RV, int NK>
struct TiledBf16 {
  static constexpr int W = 16, RB = RV * W;
  static constexpr int64_t kTileKeys = kTiledKeys;
  static constexpr int64_t kTilePad = (kTileKeys + NK - 1) / NK * NK;
  static constexpr int kMaxSub = RV;
  static constexpr bool kPrefetchSpread = true;

  static constexpr int kD = D;
  int64_t d;
  float qs = 0;            // scale * log2 e, applied to S
  uint32_t* qp = nullptr;  // per block: (d/2, RB) words of q as bf16 head-dim pairs
  uint16_t* kp = nullptr;  // the tile's K, (kTilePad, d) bf16
  uint32_t* vp = nullptr;  // the tile's V as key pairs, (kTilePad/2, d) words

  explicit TiledBf16(const KvView& kv) : d(D > 0 ? D : kv.head_dim) {}

  RowBlocks blocks(int64_t n_rows) const { return RowBlocks({0, RB, RV, W, NK, RB, 0}, (n_rows + RB - 1) / RB); }

  // q rounded to bf16 (nearest even), head dims in pairs, lanes past n_rows zero; row by row, each query row
  // read once in order.
  void begin(const float* q, int64_t n_rows, const RowBlocks& blocks, float scale, Scratch& sc) {
    const int64_t n_words = blocks.rows() * d / 2;
    qp = reinterpret_cast<uint32_t*>(sc.get(0, n_words));
    kp = reinterpret_cast<uint16_t*>(sc.get(4, kTilePad * d / 2));
    vp = reinterpret_cast<uint32_t*>(sc.get(5, kTilePad * d / 2));
    qs = scale * kLog2e;
    std::fill(qp, qp + n_words, 0u);
    for (int64_t r = 0; r < n_rows; ++r) {
      const float* __restrict qr = q + r * d;
      uint32_t* __restrict dst = qp + (r / RB) * RB * d / 2 + r % RB;
      for (int64_t k = 0; k < d; k += 2) {
        const uint32_t lo = Eigen::numext::bit_cast<uint16_t>(bf16(qr[k]));
        const uint32_t hi = Eigen::numext::bit_cast<uint16_t>(bf16(qr[k + 1]));
        dst[k / 2 * RB] = lo | hi << 16;
      }
    }
  }

  void load_tile(const KvView& kv, int kvh, int64_t a, int64_t n, Scratch&) {
    bf16_panels(kv, kvh, a, n, (n + NK - 1) / NK * NK, d, kp, vp);
  }

  void step(const RowBlock& b, int64_t c, int nk, const uint32_t* bits, int64_t bits_stride, float* ot, float* m,
            float* l) const {
    const int64_t d = D > 0 ? D : this->d;
    tile_block_bf16<D, RV, NK>(qp + b.r0 * d / 2, kp + c * d, vp + c / 2 * d, d, qs, nk, bits, bits_stride, ot, m, l);
  }
};

// The tiled kernel for bf16 K/V on bf16 dot products (see run_tiled).
template <int D, int RV, int NK, class Mask>
void tile_attend(const float* q, int64_t n_rows, const KvView& kv, int kvh, int64_t t0, int64_t t1, const Mask& mask,
                 float scale, float* o, float* lse, Scratch& sc) {
  TiledBf16<D, RV, NK> p(kv);
  run_tiled(p, q, n_rows, kv, kvh, t0, t1, mask, scale, o, lse, sc);
}

// ---- the per-sequence pass on vdpbf16ps ---------------------------------------------------------------------
//
// The few-rows kernel for bf16 K/V (head dim a multiple of 32) on bf16 dot products, with the tiled policy's
// rounding above: q rounded to bf16 (S scaled in f32 afterwards), the softmax weights rounded to bf16 for P V
// while their sum l stays f32. K as stored pairs head dims; for P V the rows of two keys are interleaved word by
// word in registers (vpunpck{l,h}wd), so an accumulator row holds each 32-dim block's dims in the order those give
// (few_pair_dim), put back in order once at the end. Nothing is converted to f32: per key and row the products
// take half the instructions of the f32 kernel, with no conversions beside them (where a 512-bit conversion is
// slow, the f32 kernel spends about as long converting K/V as multiplying: docs/study.md §18).

using avx512::few_pair_dim;

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

// The few-rows kernel for bf16 K/V on bf16 dot products; head_dim is NB * 32 (NB = 0: known at run time, a
// multiple of 32).
template <int NB>
struct FewBf16 {
  using Elem = uint16_t;
  static constexpr int64_t kChunk = kFewChunk;
  static constexpr bool kPrefetch = true;

  static constexpr int kD = NB * 32;
  int64_t d, nb;
  float qs = 0;            // scale * log2 e, applied to S
  uint32_t* qp = nullptr;  // (n_heads, n_rows, d/2) words: q as bf16 head-dim pairs
  uint32_t* pp = nullptr;  // one head's weights of a tile as bf16 key pairs, (kFewRows, kFewTile/2) words
  float* row = nullptr;    // one row's accumulated output in head-dim order

  explicit FewBf16(const KvView& kv) : d(kv.head_dim), nb(NB > 0 ? NB : kv.head_dim / 32) {}

  void begin(const float* q, int64_t n_state, float scale, Scratch& sc) {
    qp = reinterpret_cast<uint32_t*>(sc.get(0, n_state * d / 2));
    pp = reinterpret_cast<uint32_t*>(sc.get(5, kFewRows * kFewTile / 2));
    row = sc.get(6, d);
    qs = scale * kLog2e;
    // q rounded to bf16 (nearest even), head dims in pairs: 16 pairs per 32 floats
    for (int64_t i = 0; i < n_state * d; i += 16) {
      const __m256i w = __m256i(_mm512_cvtneps_pbh(_mm512_loadu_ps(q + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp + i / 2), w);
    }
  }
  static constexpr int64_t score_steps(int64_t n) { return few_bf16_score_steps(n); }
  int64_t pv_steps(int64_t n_rows, int64_t n) const { return few_bf16_pv_steps(NB, nb, n_rows, n); }

  // Row groups of kFewBf16RowGroup rows; the first group's loop carries the prefetches.
  void scores(int h, int64_t n_rows, const uint16_t* kt, int64_t stride, int64_t n, float* s, FewPrefetch* pf) const {
    for (int64_t r0 = 0; r0 < n_rows; r0 += kFewBf16RowGroup) {
      const uint32_t* qh = qp + (h * n_rows + r0) * d / 2;
      float* sr = s + r0 * kFewTile;
      FewPrefetch* p = r0 == 0 ? pf : nullptr;
      switch (std::min<int64_t>(kFewBf16RowGroup, n_rows - r0)) {
        case 1: few_scores_bf16<NB, 1>(qh, kt, stride, n, nb, qs, sr, p); break;
        case 2: few_scores_bf16<NB, 2>(qh, kt, stride, n, nb, qs, sr, p); break;
        case 3: few_scores_bf16<NB, 3>(qh, kt, stride, n, nb, qs, sr, p); break;
        default: few_scores_bf16<NB, 4>(qh, kt, stride, n, nb, qs, sr, p); break;
      }
    }
  }

  // The weights as bf16 key pairs, zero past key n (a row that sees nothing yet holds -inf there), then P V.
  void pv(const float* p, int64_t n_rows, const uint16_t* vt, int64_t stride, int64_t n, float* acc,
          FewPrefetch* pf) const {
    uint16_t* pw = reinterpret_cast<uint16_t*>(pp);
    for (int64_t r = 0; r < n_rows; ++r)
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
        const __m512 w = _mm512_maskz_loadu_ps(live, p + r * kFewTile + j);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + r * kFewTile + j), __m256i(_mm512_cvtneps_pbh(w)));
      }
    few_pv_bf16<NB>(pp, n_rows, vt, stride, n, nb, acc, d, pf);
  }

  // The accumulator's dims put back in order (few_pair_dim), then the row's normalized state.
  void finish(const float* acc, float m, float l, float* o, float* lse) const {
    for (int64_t c = 0; c < d; c += 32)
      for (int64_t i = 0; i < 32; ++i) row[c + few_pair_dim(i)] = acc[c + i];
    finish_row(row, 1, m, l, d, o, lse);
  }
};

// The few-rows kernel for bf16 K/V on bf16 dot products (see run_few).
template <int NB, class Mask>
void few_attend(const float* q, int64_t n_rows, int n_heads, const KvView& kv, int kvh, int64_t t0, int64_t t1,
                const Mask& mask, float scale, float* o, float* lse, Scratch& sc) {
  FewBf16<NB> p(kv);
  run_few(p, q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
}

// Multiply-adds per second of vdpbf16ps over those of 512-bit f32 FMAs on the calling core: each instruction
// stream timed over 12 independent chains of 2,048 steps, best of three, the two kinds alternating. It differs by
// CPU, far above 1 on some and far below on others (docs/study.md §18, §20): the choice of products follows it.
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

#endif  // CASCADE_X86
