// The per-sequence pass for q8_0 K/V on integer dot products (AVX512_VNNI: vpdpbusd and vpdpwssd), a products
// policy of the few-rows driver (kernel_driver.inc). Compiled for AVX512_VNNI whatever the build's flags; the plan
// chooses it (kernel.hpp: choose_kernel) only where cpu_features() has it.
//
// S = Q K^T multiplies K's codes as stored against q quantized to int8 the same way (per block of 32 head dims: a
// scale max |q| / 127, kept in f32, and codes rounded to nearest), so each block's dot product is exact in int32
// and only its two scales are applied in f32. Lanes hold keys: a chunk's 16 keys are loaded 64 codes each and
// transposed in registers to (4-dim group, key) words, which vpdpbusd multiplies by a broadcast 4-dim group of
// q, 64 multiply-adds an instruction, with no reduction across lanes afterwards. vpdpbusd multiplies unsigned
// bytes by signed ones: the codes of K are offset by 128 (k + 128 in [1, 255]) and the block's sum of q's codes
// times 128 is taken off where its accumulation starts, so the sum is q . k exactly.
//
// P V multiplies V's codes, sign-extended to 16 bits, by 16-bit weights on vpdpwssd (two keys a word, 32 multiply-
// adds an instruction): per tile, row and block of 32 head dims, the softmax weight of key j times V's scale of
// that block, w_j, is rounded to an integer multiple of max_j w_j / 32767. The products are exact in int32 over a
// tile, and each tile's sum is scaled into the f32 accumulator. A weight moves by at most max_j w_j / 65534, so
// with at most 64 keys a tile, |o - o_exact| <= 64 / 65534 max |v| (about 2^-10 of the largest |v|); the sum l of
// the weights stays f32. The rows of two keys are interleaved word by word in registers (vpunpck{l,h}wd), so an
// accumulator holds each 32-dim block's dims in few_pair_dim's order, put back in order once at the end.
//
// Beyond that, the only rounding is q's: q already on the q8_0 grid (q8_0.hpp's codes times its f16 block scales)
// is quantized exactly, and S is then the f32 kernel's to the rounding of f32 sums.
//
// The shared pass for q8_0 K/V converts each K/V tile to bf16 once (code times scale, rounded to nearest even) and
// runs the bf16 policies on it: vdpbf16ps (kernel_bf16.hpp) or AMX tiles (kernel_amx.hpp), where bf16 K/V would run
// on them (choose_kernel). Their rounding is the bf16 kernels' (q and the softmax weights to bf16) plus that of
// each K/V element to bf16 (a relative 2^-9 at most; none where the scales are powers of two, since a code has 7
// significant bits). Elsewhere it converts tiles to f32 (the f32 products' Elems<Q8Code>).
#pragma once

#include "cascade/simd.hpp"  // before oneTBB and Eigen, which include the intrinsics too

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cascade/cpu/kernel_amx.hpp"
#include "cascade/cpu/kernel_avx512.hpp"
#include "cascade/q8_0.hpp"

#if CASCADE_X86

CASCADE_TARGET_AVX512_VNNI_BEGIN
namespace cascade::cpu::avx512_vnni {

// The driver, compiled here for the policy (kernel_driver.inc), on the AVX-512 tier's vector pieces.
#include "cascade/cpu/kernel_driver_avx512.inc"
using avx512::Elems;

// Keys per chunk of the score loop: one register of lanes.
inline constexpr int64_t kQ8Chunk = 16;
static_assert(kFewTile % kQ8Chunk == 0);

// A state row's q for the integer products: its codes (d bytes), and per block of 32 head dims its scale times the
// softmax's (log2 units) and -128 times the sum of its codes (where the block's accumulation starts).
struct QuantizedQ {
  int8_t* codes = nullptr;  // (n_state, d)
  float* scales = nullptr;  // (n_state, d / 32)
  int32_t* start = nullptr;  // (n_state, d / 32)
};

// Quantizes n_state rows of d floats (d a multiple of 32) into qq, block scales times `factor`.
inline void quantize_q(const float* q, int64_t n_state, int64_t d, float factor, const QuantizedQ& qq) {
  const int64_t nb = d / kQ8Block;
  for (int64_t r = 0; r < n_state; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* x = q + r * d + b * kQ8Block;
      __m512 amax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x)), _mm512_abs_ps(_mm512_loadu_ps(x + 16)));
      const float scale = _mm512_reduce_max_ps(amax) / 127.0f;
      const __m512 inv = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
      int8_t* c = qq.codes + r * d + b * kQ8Block;
      __m512i sum = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * h), inv));  // to nearest even
        _mm_storeu_si128(reinterpret_cast<__m128i*>(c + 16 * h), _mm512_cvtsepi32_epi8(v));
        sum = _mm512_add_epi32(sum, v);
      }
      qq.scales[r * nb + b] = scale * factor;
      qq.start[r * nb + b] = -128 * _mm512_reduce_add_epi32(sum);
    }
}

// The chunk's K as (4-dim group, key) words, 64 head dims [64 c, 64 c + 64) of keys j < n (rows `stride` codes
// apart; keys past n read as zero codes), offset to unsigned (code + 128).
CASCADE_ALWAYS_INLINE void k_transposed(const Q8Code* kt, int64_t stride, int64_t n, int64_t c, __m512i (&kw)[16]) {
  const __m512i offset = _mm512_set1_epi8(char(0x80));
  CASCADE_UNROLL(16)
  for (int j = 0; j < 16; ++j)
    kw[j] = _mm512_xor_si512(j < n ? _mm512_loadu_si512(kt + j * stride + c * 64) : _mm512_setzero_si512(), offset);
  avx512::transpose16(kw);
}

// The K scales of the chunk's keys j < n (0 past n) for blocks 2c and 2c + 1: one f16 pair a key, gathered.
// scales: the scale of the chunk's first key's first block; key_step: f16s from one key's scales to the next.
CASCADE_ALWAYS_INLINE void k_scales(const uint16_t* scales, int64_t key_step, int64_t n, int64_t c, __m512& s0,
                                    __m512& s1) {
  const __mmask16 live = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(int32_t(key_step * 2)));
  const __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx, scales + 2 * c, 1);
  s0 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pairs));
  s1 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16)));
}

// s(r, j) for R rows and the chunk's keys (16 lanes; those past n hold nothing of use), NC groups of 64 head dims
// (0: nc at run time). qq: the rows' quantized q, from the first; s: (R, kFewTile).
template <int NC, int R>
inline void q8_scores_rows(const QuantizedQ& qq, int64_t d, const Q8Code* kt, const uint16_t* ks, int64_t stride,
                           int64_t n, int64_t nc_rt, float* s, FewPrefetch* pf) {
  const int64_t nc = NC > 0 ? NC : nc_rt, nb = d / kQ8Block;
  __m512 acc[R];
  CASCADE_UNROLL(8)
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < nc; ++c) {
    if (pf) pf->step();
    __m512i kw[16];
    k_transposed(kt, stride, n, c, kw);
    __m512 s0, s1;
    k_scales(ks, stride / kQ8Block, n, c, s0, s1);
    CASCADE_UNROLL(8)
    for (int r = 0; r < R; ++r) {
      const int32_t* qw = reinterpret_cast<const int32_t*>(qq.codes + r * d + c * 64);
      __m512i i0 = _mm512_set1_epi32(qq.start[r * nb + 2 * c]), i1 = _mm512_set1_epi32(qq.start[r * nb + 2 * c + 1]);
      CASCADE_UNROLL(8)
      for (int t = 0; t < 8; ++t) {
        i0 = _mm512_dpbusd_epi32(i0, kw[t], _mm512_set1_epi32(qw[t]));
        i1 = _mm512_dpbusd_epi32(i1, kw[8 + t], _mm512_set1_epi32(qw[8 + t]));
      }
      const float* sq = qq.scales + r * nb + 2 * c;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(s0, _mm512_set1_ps(sq[0])), acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(s1, _mm512_set1_ps(sq[1])), acc[r]);
    }
  }
  CASCADE_UNROLL(8)
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * kFewTile, acc[r]);
}

// One tile's weights for P V on vpdpwssd, per row and block of 32 head dims: w_j = p(r, j) times V's scale of key j
// in that block, as 16-bit multiples of max_j w_j / 32767 (zero past the tile's n keys), in key pairs, and that
// unit. pairs: (R, nb, kFewTile / 2) words; unit: (R, nb); v_scales: the tile's V scales, (nb, kFewTile).
struct Q8Weights {
  uint32_t* pairs = nullptr;
  float* unit = nullptr;
  float* v_scales = nullptr;
};

// The weights of a tile of n keys for n_rows rows of p ((n_rows, kFewTile) probabilities). vs: V's scale of the
// tile's first key and block; stride: codes from one key's row to the next.
inline void q8_weights(const float* p, int64_t n_rows, const uint16_t* vs, int64_t stride, int64_t n, int64_t nb,
                       const Q8Weights& w) {
  const int64_t key_step = stride / kQ8Block;
  for (int64_t c = 0; c < nb / 2; ++c)
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      __m512 s0, s1;
      k_scales(vs + j0 * key_step, key_step, n - j0, c, s0, s1);
      _mm512_storeu_ps(w.v_scales + 2 * c * kFewTile + j0, s0);
      _mm512_storeu_ps(w.v_scales + (2 * c + 1) * kFewTile + j0, s1);
    }
  const int64_t n_vec = (n + 15) / 16;
  for (int64_t r = 0; r < n_rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      __m512 x[kFewTile / 16];
      __m512 mx = _mm512_setzero_ps();
      for (int64_t g = 0; g < n_vec; ++g) {
        const __mmask16 live = n - 16 * g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - 16 * g)) - 1);
        x[g] = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, p + r * kFewTile + 16 * g),
                             _mm512_loadu_ps(w.v_scales + b * kFewTile + 16 * g));
        mx = _mm512_max_ps(mx, x[g]);
      }
      const float top = _mm512_reduce_max_ps(mx);
      const __m512 inv = _mm512_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
      int16_t* out = reinterpret_cast<int16_t*>(w.pairs + (r * nb + b) * (kFewTile / 2));
      for (int64_t g = 0; g < n_vec; ++g)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * g),
                            _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x[g], inv))));
      w.unit[r * nb + b] = top / 32767.0f;
    }
}

// acc(r, :) += sum_j p(r, j) v_j for R rows from the tile's weights w, CB 32-dim blocks a pass: per key pair, the
// two rows' codes of each block sign-extended and interleaved (vpunpck{l,h}wd), then one vpdpwssd per row and
// 16 lanes. acc: (R, d), each 32-dim block in few_pair_dim order. pf is stepped once per key pair of each pass.
template <int R, int CB>
inline void q8_pv_rows(const Q8Weights& w, const Q8Code* vt, int64_t stride, int64_t n, int64_t nb, float* acc,
                       int64_t d, FewPrefetch* pf_in) {
  FewPrefetch pf_local;  // in registers over the loops, not through the pointer
  FewPrefetch* pf = pf_in ? &pf_local : nullptr;
  if (pf_in) pf_local = *pf_in;
  constexpr int64_t PS = kFewTile / 2;  // words per row and block of w.pairs
  for (int64_t c0 = 0; c0 < nb; c0 += CB) {
    __m512i a[R][CB][2];
    CASCADE_UNROLL(8)
    for (int r = 0; r < R; ++r)
      CASCADE_UNROLL(4)
      for (int c = 0; c < CB; ++c) a[r][c][0] = a[r][c][1] = _mm512_setzero_si512();
    for (int64_t j = 0; j < n; j += 2) {
      if (pf) pf->step();
      const bool y1 = j + 1 < n;
      CASCADE_UNROLL(4)
      for (int c = 0; c < CB; ++c) {
        const int64_t at = (c0 + c) * kQ8Block;
        const auto codes = [&](int64_t key) {
          return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vt + key * stride + at)));
        };
        const __m512i x = codes(j), y = y1 ? codes(j + 1) : _mm512_setzero_si512();
        const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
        CASCADE_UNROLL(8)
        for (int r = 0; r < R; ++r) {
          const __m512i wr = _mm512_set1_epi32(int32_t(w.pairs[(r * nb + c0 + c) * PS + j / 2]));
          a[r][c][0] = _mm512_dpwssd_epi32(a[r][c][0], lo, wr);
          a[r][c][1] = _mm512_dpwssd_epi32(a[r][c][1], hi, wr);
        }
      }
    }
    CASCADE_UNROLL(8)
    for (int r = 0; r < R; ++r)
      CASCADE_UNROLL(4)
      for (int c = 0; c < CB; ++c) {
        const __m512 unit = _mm512_set1_ps(w.unit[r * nb + c0 + c]);
        float* ar = acc + r * d + (c0 + c) * kQ8Block;
        CASCADE_UNROLL(2)
        for (int h = 0; h < 2; ++h)
          _mm512_storeu_ps(ar + 16 * h,
                           _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r][c][h]), unit, _mm512_loadu_ps(ar + 16 * h)));
      }
  }
  if (pf_in) *pf_in = pf_local;
}

// Blocks per pass of q8_pv_rows for R rows and NB blocks (0: known at run time, one at a time): as many as fit 24
// accumulators.
inline constexpr int q8_pv_cb(int NB, int R) {
  if (NB <= 0) return 1;
  int cb = NB;
  while (cb > 1 && (2 * R * cb > 24 || NB % cb != 0)) --cb;
  return cb;
}

// The step() calls of q8_pv over n keys for n_rows rows, NB blocks (nb at run time).
inline constexpr int64_t q8_pv_steps(int NB, int64_t nb, int64_t n_rows, int64_t n) {
  const int r = int(std::min<int64_t>(n_rows, kFewRows));
  const int64_t passes = NB > 0 ? NB / q8_pv_cb(NB, r) : nb;
  return passes * ((n + 1) / 2);
}

template <int NB>
inline void q8_pv(const Q8Weights& w, int64_t n_rows, const Q8Code* vt, int64_t stride, int64_t n, int64_t nb,
                  float* acc, int64_t d, FewPrefetch* pf) {
  switch (n_rows) {
#define CASCADE_Q8_PV_CASE(R) \
  case R: return q8_pv_rows<R, q8_pv_cb(NB, R)>(w, vt, stride, n, nb, acc, d, pf);
    CASCADE_Q8_PV_CASE(1)
    CASCADE_Q8_PV_CASE(2)
    CASCADE_Q8_PV_CASE(3)
    CASCADE_Q8_PV_CASE(4)
    CASCADE_Q8_PV_CASE(5)
    CASCADE_Q8_PV_CASE(6)
    CASCADE_Q8_PV_CASE(7)
#undef CASCADE_Q8_PV_CASE
    default: return q8_pv_rows<8, q8_pv_cb(NB, 8)>(w, vt, stride, n, nb, acc, d, pf);
  }
}

// The few-rows kernel for q8_0 K/V (head dim NC * 64; NC = 0: known at run time) on int8 dot products.
template <int NC>
struct FewQ8Dot {
  using Elem = Q8Code;
  static constexpr int64_t kChunk = kQ8Chunk;
  static constexpr bool kPrefetch = true;

  static constexpr int kD = NC * 64;
  static constexpr int NB = NC * 2;  // 32-dim blocks
  int64_t d, nc, nb;
  QuantizedQ qq;
  Q8Weights w;
  float* row = nullptr;  // one row's accumulated output in head-dim order
  Elems<Q8Code> ke, ve;

  explicit FewQ8Dot(const KvView& kv)
      : d(kv.head_dim), nc(kv.head_dim / 64), nb(kv.head_dim / kQ8Block), ke(kv, false), ve(kv, true) {}

  void begin(const float* q, int64_t n_state, float scale, Scratch& sc) {
    float* buf = sc.get(0, n_state * (d / 4 + 2 * nb));
    qq.codes = reinterpret_cast<int8_t*>(buf);
    qq.scales = buf + n_state * d / 4;
    qq.start = reinterpret_cast<int32_t*>(qq.scales + n_state * nb);
    quantize_q(q, n_state, d, scale * kLog2e, qq);
    float* wb = sc.get(5, kFewRows * nb * (kFewTile / 2 + 1) + nb * kFewTile);
    w.pairs = reinterpret_cast<uint32_t*>(wb);
    w.unit = wb + kFewRows * nb * kFewTile / 2;
    w.v_scales = w.unit + kFewRows * nb;
    row = sc.get(6, d);
  }
  // One step per 64 head dims of a chunk.
  int64_t score_steps(int64_t) const { return nc; }
  int64_t pv_steps(int64_t n_rows, int64_t n) const { return q8_pv_steps(NB, nb, n_rows, n); }

  void scores(int h, int64_t n_rows, const Q8Code* kt, int64_t stride, int64_t n, float* s, FewPrefetch* pf) const {
    const uint16_t* ks = ke.scales + size_t(kt - ke.codes) / kQ8Block;
    const int64_t nb = d / kQ8Block;
    for (int64_t r0 = 0; r0 < n_rows; r0 += kFewRows) {
      const QuantizedQ rq{qq.codes + (h * n_rows + r0) * d, qq.scales + (h * n_rows + r0) * nb,
                          qq.start + (h * n_rows + r0) * nb};
      float* sr = s + r0 * kFewTile;
      FewPrefetch* p = r0 == 0 ? pf : nullptr;
      switch (std::min<int64_t>(kFewRows, n_rows - r0)) {
        case 1: q8_scores_rows<NC, 1>(rq, d, kt, ks, stride, n, nc, sr, p); break;
        case 2: q8_scores_rows<NC, 2>(rq, d, kt, ks, stride, n, nc, sr, p); break;
        case 3: q8_scores_rows<NC, 3>(rq, d, kt, ks, stride, n, nc, sr, p); break;
        case 4: q8_scores_rows<NC, 4>(rq, d, kt, ks, stride, n, nc, sr, p); break;
        case 5: q8_scores_rows<NC, 5>(rq, d, kt, ks, stride, n, nc, sr, p); break;
        case 6: q8_scores_rows<NC, 6>(rq, d, kt, ks, stride, n, nc, sr, p); break;
        case 7: q8_scores_rows<NC, 7>(rq, d, kt, ks, stride, n, nc, sr, p); break;
        default: q8_scores_rows<NC, 8>(rq, d, kt, ks, stride, n, nc, sr, p); break;
      }
    }
  }
  void pv(const float* p, int64_t n_rows, const Q8Code* vt, int64_t stride, int64_t n, float* acc,
          FewPrefetch* pf) const {
    q8_weights(p, n_rows, ve.scales + size_t(vt - ve.codes) / kQ8Block, stride, n, nb, w);
    q8_pv<NB>(w, n_rows, vt, stride, n, nb, acc, d, pf);
  }
  // The accumulator's dims put back in order (few_pair_dim), then the row's normalized state.
  void finish(const float* acc, float m, float l, float* o, float* lse) const {
    for (int64_t c = 0; c < d; c += 32)
      for (int64_t i = 0; i < 32; ++i) row[c + avx512::few_pair_dim(i)] = acc[c + i];
    finish_row(row, 1, m, l, d, o, lse);
  }
};

// The few-rows kernel for q8_0 K/V on int8 dot products (see run_few); head_dim a multiple of 64.
template <int NC, class Mask>
void few_attend(const float* q, int64_t n_rows, int n_heads, const KvView& kv, int kvh, int64_t t0, int64_t t1,
                const Mask& mask, float scale, float* o, float* lse, Scratch& sc) {
  FewQ8Dot<NC> p(kv);
  run_few(p, q, n_rows, n_heads, kv, kvh, t0, t1, mask, scale, o, lse, sc);
}

}  // namespace cascade::cpu::avx512_vnni
CASCADE_TARGET_END

// ---- the shared pass: tiles converted to bf16 ------------------------------------------------------------------

CASCADE_TARGET_AVX512_BF16_BEGIN
namespace cascade::cpu::avx512_bf16 {

// 32 bf16 of one q8_0 block: codes times the block's scale, rounded to nearest even.
CASCADE_ALWAYS_INLINE __m512i q8_block_bf16(const Q8Code* codes, uint16_t scale) {
  const __m512 sv = _mm512_set1_ps(_cvtsh_ss(scale));
  const auto part = [&](int h) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * h));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), sv);
  };
  return __m512i(_mm512_cvtne2ps_pbh(part(1), part(0)));
}

// Tokens [a, a + n) of q8_0 head kvh of K (values: of V) as bf16 rows of d, rows n..n_pad zero; rows `stride`
// elements apart from dst.
inline void q8_rows_bf16(const KvView& kv, bool values, int kvh, int64_t a, int64_t n, int64_t n_pad, int64_t d,
                         uint16_t* dst, int64_t stride) {
  const avx512::Elems<Q8Code> e(kv, values);
  for (int64_t j = 0; j < n; ++j) {
    const Q8Code* row = e.codes + kv.offset(a + j, kvh);
    const uint16_t* sc = e.scales + kv.scale_offset(a + j, kvh);
    for (int64_t i = 0; i < d; i += kQ8Block)
      _mm512_storeu_si512(dst + j * stride + i, q8_block_bf16(row + i, sc[i / kQ8Block]));
  }
  for (int64_t j = n; j < n_pad; ++j) std::memset(dst + j * stride, 0, size_t(d) * 2);
}

// The tiled kernel for q8_0 K/V on vdpbf16ps: TiledBf16 on each tile converted to bf16 (its V key pairs from the
// converted rows).
template <int D, int RV, int NK>
struct TiledQ8Bf16 : TiledBf16<D, RV, NK> {
  using Base = TiledBf16<D, RV, NK>;
  uint16_t* rows = nullptr;  // the tile's V rows as bf16, (kTilePad, d)
  explicit TiledQ8Bf16(const KvView& kv) : Base(kv) {}
  void begin(const float* q, int64_t n_rows, const RowBlocks& blocks, float scale, Scratch& sc) {
    Base::begin(q, n_rows, blocks, scale, sc);
    rows = reinterpret_cast<uint16_t*>(sc.get(7, Base::kTilePad * this->d / 2));
  }
  void load_tile(const KvView& kv, int kvh, int64_t a, int64_t n, Scratch&) {
    const int64_t d = this->d, n_pad = (n + NK - 1) / NK * NK;
    q8_rows_bf16(kv, false, kvh, a, n, n_pad, d, this->kp, d);
    q8_rows_bf16(kv, true, kvh, a, n, n, d, rows, d);
    const bf16* v = reinterpret_cast<const bf16*>(rows);
    bf16_v_pairs(KvView::contiguous(v, v, n, 1, int(d)), 0, 0, n, n_pad, d, this->vp);
  }
};

// The tiled kernel for q8_0 K/V on vdpbf16ps (see run_tiled).
template <int D, int RV, int NK, class Mask>
void tile_attend_q8(const float* q, int64_t n_rows, const KvView& kv, int kvh, int64_t t0, int64_t t1,
                    const Mask& mask, float scale, float* o, float* lse, Scratch& sc) {
  TiledQ8Bf16<D, RV, NK> p(kv);
  run_tiled(p, q, n_rows, kv, kvh, t0, t1, mask, scale, o, lse, sc);
}

}  // namespace cascade::cpu::avx512_bf16

#if defined(CASCADE_AMX_KERNEL)
namespace cascade::cpu::amx {

// The tiled kernel for q8_0 K/V on AMX tiles: TiledAmx on each tile converted to bf16, its K steps loading from the
// converted rows (zero-padded to whole steps) and V^T built from them.
template <int D>
struct TiledAmxQ8 : TiledAmx<D> {
  using Base = TiledAmx<D>;
  uint16_t* k_rows = nullptr;  // the tile's K and V as bf16, (kTileKeys, d) each
  uint16_t* v_rows = nullptr;
  explicit TiledAmxQ8(const KvView& kv) : Base(kv) {}
  void begin(const float* q, int64_t n_rows, const RowBlocks& blocks, float scale, Scratch& sc) {
    Base::begin(q, n_rows, blocks, scale, sc);
    k_rows = reinterpret_cast<uint16_t*>(sc.get(5, kTileKeys * this->d));
    v_rows = k_rows + kTileKeys * this->d;
  }
  void load_tile(const KvView& kv, int kvh, int64_t a, int64_t n, Scratch&) {
    const int64_t d = this->d, n_pad = (n + kStep - 1) / kStep * kStep;
    avx512_bf16::q8_rows_bf16(kv, false, kvh, a, n, n_pad, d, k_rows, d);
    avx512_bf16::q8_rows_bf16(kv, true, kvh, a, n, n, d, v_rows, d);
    this->k_run = k_rows;
    this->ks = d;
    this->n_full = n_pad;
    const bf16* v = reinterpret_cast<const bf16*>(v_rows);
    v_transposed(KvView::contiguous(v, v, n, 1, int(d)), 0, 0, n, n_pad, d, this->vt);
  }
};

// The tiled kernel for q8_0 K/V on AMX tiles (see run_tiled).
template <int D, class Mask>
void tile_attend_q8(const float* q, int64_t n_rows, const KvView& kv, int kvh, int64_t t0, int64_t t1,
                    const Mask& mask, float scale, float* o, float* lse, Scratch& sc) {
  TiledAmxQ8<D> p(kv);
  avx512_bf16::run_tiled(p, q, n_rows, kv, kvh, t0, t1, mask, scale, o, lse, sc);
}

}  // namespace cascade::cpu::amx
#endif  // CASCADE_AMX_KERNEL
CASCADE_TARGET_END

#endif  // CASCADE_X86
