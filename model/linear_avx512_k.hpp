// The avx512-vnni tier's own tiles by lanes of K (1-3 rows of X), beside the shared tile_k (linear_tile_k.inc):
// q4_0 and q4_1 four blocks a step (tile_q4), q4_K and q5_K (tile_q4k) and q6_K (tile_q6k) 128 values a step, each
// nibble of a 64-byte load against the activations' values it meets and each half of the dot product in one
// group; q8_0 keeps tile_k on 64-code chunks. Each comes with its TileQ* for rows_by_k.
#pragma once

#include "model/linear_avx512_decode.hpp"

#if CASCADE_X86
CASCADE_LINEAR_TARGET_AVX512_VNNI_BEGIN
namespace cascade::linear::detail::avx512_vnni {
namespace {  // internal linkage, as linear_x86.inc

// The scratch tile_q4 needs for `rows` rows x rows of X: each one's group products, whole windows of 16.
inline int64_t q4_comb_floats(int64_t rows, int64_t n_in) { return rows * ((n_in / 32 + 15) / 16 * 16); }

// tile_q4's group numbers for R rows (row[r]; the matrix ends at limit) and T rows of X from t0: each row's scales
// and offsets 16 groups at a time into registers (Codes64::scales16), then comb (R, T, gp) = scale[g] * d[g]
// (zero past the row's groups) and acc[r][t] = the offsets against the activations' group sums.
template <class Cd, int R, int T>
void tile_q4_groups(const uint8_t* const (&row)[R], const uint8_t* limit, const Int8Form& x, int64_t t0,
                    float* comb, __m512 (&acc)[R][T]) {
  constexpr int64_t bb = Cd::bb;
  const int64_t nu = x.n_in / 32, gp = (nu + 15) / 16 * 16;
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < nu; g += 16) {
      const int64_t n = std::min<int64_t>(16, nu - g);
      __m512 sc, off;
      // 16 q4_1 blocks are the 320 bytes scales16 reads; 16 q4_0 blocks only 288. A last window of at most 4
      // groups (SmolLM2's 576 columns: 2) from four small loads (docs/study.md, section 21).
      const int64_t room = limit - (row[r] + g * bb);
      if (n <= 4 && room >= 64)
        Cd::scales4(row[r], g, n, sc, off);
      else if ((n == 16 && 16 * bb >= 320) || room >= 320)
        Cd::template scales16<true>(row[r], g, n, sc, off);
      else
        Cd::template scales16<false>(row[r], g, n, sc, off);
      for (int t = 0; t < T; ++t) {
        // past the row's last group these read the next row's numbers (or the buffers' zero slack): times 0
        const float* d = x.d.data() + (t0 + t) * nu + g;
        const float* sg = x.s32.data() + (t0 + t) * nu + g;
        _mm512_storeu_ps(comb + (r * T + t) * gp + g, _mm512_mul_ps(sc, _mm512_loadu_ps(d)));
        acc[r][t] = _mm512_fmadd_ps(off, _mm512_loadu_ps(sg), acc[r][t]);
      }
    }
  }
}

// tile_k for q4_0 / q4_1 on 512-bit vectors. Each row's scales and offsets go straight into the group products and
// the offsets' sum (tile_q4_groups), so nothing is stored and read back narrower than it was written. Then four
// blocks a step (Codes64::quad): their low nibbles against the activations' values 0-15 of each block and their
// high nibbles against 16-31, both into one sum whose lane j belongs to block j % 4, so the four blocks' group
// products are one 128-bit load repeated. Per four blocks and row: one permute, three mask/shift ops, two dot
// products, a convert and an FMA, where two 64-code chunks took four permutes, two converts and two FMAs. (Lanes by
// blocks, j / 4, and the products permuted into place cost a permute more: docs/study.md, section 21.)
// Cd: Codes64<Q4_0 or Q4_1>. comb: scratch of q4_comb_floats(R * T, n_in) floats.
// ahead: the first row of the tile to ask for meanwhile (RowsAhead), or w.n_out for none.
template <class D, class Cd, int R, int T>
void tile_q4(const Matrix& w, int64_t i, const Int8Form& x, int64_t t0, float* out, float* comb, int64_t ahead) {
  constexpr int64_t bb = Cd::bb;
  const int64_t K = x.n_in, nu = K / 32, gp = (nu + 15) / 16 * 16;
  const uint8_t* row[R];
  const uint8_t* limit = w.data + w.bytes();  // the matrix's end
  for (int r = 0; r < R; ++r) row[r] = w.data + uint64_t(std::min(i + r, w.n_out - 1)) * w.row_bytes;
  __m512 acc[R][T];
  tile_q4_groups<Cd, R, T>(row, limit, x, t0, comb, acc);
  const int8_t* xq = x.q.data() + t0 * K;
  const RowsAhead pf(w, ahead, R, (nu + 3) / 4);
  const auto quad = [&]<bool kPartial>(int64_t q) {
    pf.step(q);
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      const __m512i v = Cd::template quad<kPartial>(row[r], 4 * q, nu - 4 * q);
      lo[r] = _mm512_and_si512(v, m4);
      hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    for (int t = 0; t < T; ++t) {
      // values 0-15 of the four blocks (dwords 0-3 of each), interleaved as the codes are, then 16-31 (dwords
      // 4-7). A last, partial quad reads past the row, into the next one or the buffer's zero slack, against zero
      // codes or scales.
      const int8_t* xp = xq + t * K + q * 128;
      const __m512i x0 = _mm512_loadu_si512(xp), x1 = _mm512_loadu_si512(xp + 64);
      const __m512i xl = _mm512_permutex2var_epi32(
          x0, _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27), x1);
      const __m512i xh = _mm512_permutex2var_epi32(
          x0, _mm512_setr_epi32(4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31), x1);
      for (int r = 0; r < R; ++r) {
        const __m512i s = D::dot(D::dot(_mm512_setzero_si512(), lo[r], xl), hi[r], xh);
        // lane j's group is 4q + j % 4: the four products repeated, a load (no permute)
        const __m512 c = _mm512_broadcast_f32x4(_mm_loadu_ps(comb + (r * T + t) * gp + 4 * q));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), c, acc[r][t]);
      }
    }
  };
  const int64_t n_full = nu / 4;
  for (int64_t q = 0; q < n_full; ++q) quad.template operator()<false>(q);
  // A last quad of fewer blocks reads the next row's codes (against zero scales) unless that would pass the
  // matrix's end; masked loads cost as much as two whole quads.
  if (nu % 4) {
    if (limit - row[R - 1] >= (n_full + 1) * 4 * bb) quad.template operator()<false>(n_full);  // row[R - 1]: the last
    else quad.template operator()<true>(n_full);
  }
  store_sums<R, T>(acc, out);
}

// rows_by_k's tile for q4_0 and q4_1 (Cd: Codes64 of either): tile_q4, its scratch taken once per call.
template <class Cd, int kR>
struct TileQ4 {
  static constexpr int R = kR;
  float* comb;
  TileQ4(const Matrix& w, const Int8Form&, int64_t, int64_t) {
    thread_local std::vector<float> scratch;
    scratch.resize(size_t(q4_comb_floats(R * 3, w.n_in)));
    comb = scratch.data();
  }
  template <int NT>
  void run(const Matrix& w, int64_t i, const Int8Form& x, int64_t t, float* out, int64_t ahead) const {
    tile_q4<Dot, Cd, R, NT>(w, i, x, t, out, comb, ahead);
  }
};

// The activations' codes in the order tile_q4k reads them: per 128 values of each row of X, the 64 its low
// nibbles meet (values 0-31 and 64-95) and then the 64 its high nibbles meet (32-63 and 96-127).
inline void q4k_activations(const Int8Form& x, int64_t t0, int64_t t1, std::vector<int8_t>& xp) {
  const int64_t K = x.n_in;
  xp.resize(size_t((t1 - t0) * K));
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t c = 0; c < K; c += 128) {
      const int8_t* src = x.q.data() + t * K + c;
      int8_t* dst = xp.data() + (t - t0) * K + c;
      const __m512i a = _mm512_loadu_si512(src), b = _mm512_loadu_si512(src + 64);
      _mm512_storeu_si512(dst, _mm512_shuffle_i64x2(a, b, 0x44));
      _mm512_storeu_si512(dst + 64, _mm512_shuffle_i64x2(a, b, 0xee));
    }
}

// tile_k for q4_K on 512-bit vectors, a block's 128 code bytes in two 64-byte loads. Bytes 0-31 of a load hold
// groups 4p and 4p + 1 of the block (low and high nibbles), bytes 32-63 groups 4p + 2 and 4p + 3 (p = 0, 1: which
// load), so its low nibbles against the activations' values of groups 4p and 4p + 2, and its high nibbles
// against 4p + 1 and 4p + 3 (q4k_activations' order), are two dot products whose lanes 0-7 and 8-15 each belong
// to one group. Each is scaled by its two groups' products (scale times the activations' d, one permute of the
// block's eight). Per 128 values and row: a load, three mask/shift ops, two dot products, two converts, two FMAs,
// where tile_k took four decodes of 32 codes, two inserts, two permutes, two converts and two FMAs. A block's
// scales and offsets come straight into registers (Codes::block_scales8), its offsets against the activations'
// group sums in eight lanes beside. q5_K too: its fifth bits (bit u of qh[l] for value l of group u) come from
// qh broadcast to both 256-bit halves, a per-half shift count bringing each group's bit to bit 4.
// xp: q4k_activations' codes of row t0 of X (then t0 + 1 ...). ahead: as tile_q4's.
template <class D, TensorType TT, int R, int T>
void tile_q4k(const Matrix& w, int64_t i, const Int8Form& x, int64_t t0, const int8_t* xp, float* out,
                 int64_t ahead) {
  static_assert(TT == TensorType::Q4_K || TT == TensorType::Q5_K);
  using Cd = Codes<TT>;
  constexpr int64_t bb = Cd::bb;
  constexpr bool q5 = TT == TensorType::Q5_K;
  constexpr int64_t qs = q5 ? 48 : 16;  // where the codes' low four bits start
  const int64_t K = x.n_in, nb = K / 256, ng = K / 32;
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) row[r] = w.data + uint64_t(std::min(i + r, w.n_out - 1)) * w.row_bytes;
  __m512 acc[R][T];
  __m256 acc_off[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps(), acc_off[r][t] = _mm256_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(15);
  // lanes 0-7 and 8-15: the groups of the low (lo) and high (hi) nibbles of load p
  const __m512i lo0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i hi0 = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m512i four = _mm512_set1_epi32(4);
  const __m512i lo1 = _mm512_add_epi32(lo0, four), hi1 = _mm512_add_epi32(hi0, four);
  // q5_K: the word shifts that bring bit u of qh to bit 4, for the groups u of lo0, hi0 (left) and lo1, hi1 (right)
  const __m512i up_l0 = word_halves(4, 2), up_h0 = word_halves(3, 1);
  const __m512i down_l1 = word_halves(0, 2), down_h1 = word_halves(1, 3);
  const __m512i m10 = _mm512_set1_epi8(0x10);
  const RowsAhead pf(w, ahead, R, nb);
  for (int64_t b = 0; b < nb; ++b) {
    pf.step(b);
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = row[r] + b * bb;
      __m256 sc, off;
      Cd::block_scales8(blk, sc, off);
      const __m512i v0 = _mm512_loadu_si512(blk + qs), v1 = _mm512_loadu_si512(blk + qs + 64);
      __m512i l0, h0, l1, h1;
      if constexpr (q5) {
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
        const auto with = [&](__m512i nib, __m512i bit) {
          return _mm512_ternarylogic_epi32(nib, m4, _mm512_and_si512(bit, m10), 0xea);  // (nib & 15) | bit
        };
        l0 = with(v0, _mm512_sllv_epi16(q, up_l0));
        h0 = with(_mm512_srli_epi16(v0, 4), _mm512_sllv_epi16(q, up_h0));
        l1 = with(v1, _mm512_srlv_epi16(q, down_l1));
        h1 = with(_mm512_srli_epi16(v1, 4), _mm512_srlv_epi16(q, down_h1));
      } else {
        l0 = _mm512_and_si512(v0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
        l1 = _mm512_and_si512(v1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
      }
      for (int t = 0; t < T; ++t) {
        const int64_t xo = (t0 + t) * ng + 8 * b;
        const __m512 c = _mm512_castps256_ps512(_mm256_mul_ps(sc, _mm256_loadu_ps(x.d.data() + xo)));
        acc_off[r][t] = _mm256_fmadd_ps(off, _mm256_loadu_ps(x.s32.data() + xo), acc_off[r][t]);
        const int8_t* xb = xp + t * K + 256 * b;
        const __m512i z = _mm512_setzero_si512();
        __m512 a = acc[r][t];
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D::dot(z, l0, _mm512_loadu_si512(xb))),
                            _mm512_permutexvar_ps(lo0, c), a);
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D::dot(z, h0, _mm512_loadu_si512(xb + 64))),
                            _mm512_permutexvar_ps(hi0, c), a);
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D::dot(z, l1, _mm512_loadu_si512(xb + 128))),
                            _mm512_permutexvar_ps(lo1, c), a);
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D::dot(z, h1, _mm512_loadu_si512(xb + 192))),
                            _mm512_permutexvar_ps(hi1, c), a);
        acc[r][t] = a;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_zextps256_ps512(acc_off[r][t]));
  store_sums<R, T>(acc, out);
}

// tile_k for q6_K on 512-bit vectors, as tile_q4k. Half h of a block (values 128h .. 128h + 127) is one 64-byte
// load of ql (its low nibbles are values 0-63 of the half, its high nibbles 64-127, both in the activations'
// own order) and 32 bytes of qh, broadcast to both 256-bit halves, that give the codes' bits 4 and 5: bits 0-1
// for values 0-31, 2-3 for 32-63, 4-5 for 64-95, 6-7 for 96-127, each shifted into place by a per-half shift
// count. Lanes 4m .. 4m + 3 of a dot product belong to group m of its 64 values (groups of 16).
template <class D, int R, int T>
void tile_q6k(const Matrix& w, int64_t i, const Int8Form& x, int64_t t0, float* out, int64_t ahead) {
  constexpr int64_t bb = Codes<TensorType::Q6_K>::bb;
  const int64_t K = x.n_in, nb = K / 256, n32 = K / 32, n16 = K / 16;
  const uint8_t* row[R];
  for (int r = 0; r < R; ++r) row[r] = w.data + uint64_t(std::min(i + r, w.n_out - 1)) * w.row_bytes;
  __m512 acc[R][T], acc_off[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps(), acc_off[r][t] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
  // words of the 256-bit halves: bits 0-1 (2-3) up to 4-5 for the low nibbles, bits 4-5 (6-7) for the high
  const __m512i up_lo = word_halves(4, 2), down_hi = word_halves(0, 2);
  // the groups of 16 of each lane, for the low (values 0-63) and high (64-127) nibbles of half 0; +8 for half 1
  const __m512i g_lo = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i four = _mm512_set1_epi32(4), eight = _mm512_set1_epi32(8);
  const __m512i g[4] = {g_lo, _mm512_add_epi32(g_lo, four), _mm512_add_epi32(g_lo, eight),
                        _mm512_add_epi32(g_lo, _mm512_add_epi32(four, eight))};
  // group m of 16 has the activations' d of block m / 2
  const __m512i d_of_group = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const RowsAhead pf(w, ahead, R, nb);
  for (int64_t b = 0; b < nb; ++b) {
    pf.step(b);
    __m512 dx[T];
    for (int t = 0; t < T; ++t)
      dx[t] = _mm512_permutexvar_ps(d_of_group,
                                    _mm512_castps256_ps512(_mm256_loadu_ps(x.d.data() + (t0 + t) * n32 + 8 * b)));
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = row[r] + b * bb;
      uint16_t dh;
      std::memcpy(&dh, blk + 208, 2);
      const __m512 sc = _mm512_mul_ps(
          _mm512_set1_ps(_cvtsh_ss(dh)),
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)))));
      const __m512 off = _mm512_mul_ps(_mm512_set1_ps(-32.0f), sc);
      __m512i code[4];  // half 0 low, half 0 high, half 1 low, half 1 high
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(blk + 64 * h);
        const __m512i q =
            _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
        const __m512i t_lo = _mm512_and_si512(_mm512_sllv_epi16(q, up_lo), m30);
        const __m512i t_hi = _mm512_and_si512(_mm512_srlv_epi16(q, down_hi), m30);
        code[2 * h] = _mm512_ternarylogic_epi32(v, m4, t_lo, 0xea);  // (v & 15) | t_lo
        code[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), m4, t_hi, 0xea);
      }
      for (int t = 0; t < T; ++t) {
        const __m512 c = _mm512_mul_ps(sc, dx[t]);
        acc_off[r][t] = _mm512_fmadd_ps(off, _mm512_loadu_ps(x.s16.data() + (t0 + t) * n16 + 16 * b), acc_off[r][t]);
        const int8_t* xb = x.q.data() + (t0 + t) * K + 256 * b;
        const __m512i z = _mm512_setzero_si512();
        __m512 a = acc[r][t];
        for (int k = 0; k < 4; ++k)
          a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D::dot(z, code[k], _mm512_loadu_si512(xb + 64 * k))),
                              _mm512_permutexvar_ps(g[k], c), a);
        acc[r][t] = a;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_add_ps(acc[r][t], acc_off[r][t]);
  store_sums<R, T>(acc, out);
}

// rows_by_k's tile for q4_K and q5_K: tile_q4k, on the call's activations in q4k_activations' order.
template <TensorType TT, int kR>
struct TileQ4K {
  static constexpr int R = kR;
  const int8_t* xp;
  int64_t t0;
  TileQ4K(const Matrix&, const Int8Form& x, int64_t t0_, int64_t t1) : t0(t0_) {
    thread_local std::vector<int8_t> scratch;
    q4k_activations(x, t0, t1, scratch);
    xp = scratch.data();
  }
  template <int NT>
  void run(const Matrix& w, int64_t i, const Int8Form& x, int64_t t, float* out, int64_t ahead) const {
    tile_q4k<Dot, TT, R, NT>(w, i, x, t, xp + (t - t0) * w.n_in, out, ahead);
  }
};

// rows_by_k's tile for q6_K: tile_q6k.
template <int kR>
struct TileQ6K {
  static constexpr int R = kR;
  TileQ6K(const Matrix&, const Int8Form&, int64_t, int64_t) {}
  template <int NT>
  void run(const Matrix& w, int64_t i, const Int8Form& x, int64_t t, float* out, int64_t ahead) const {
    tile_q6k<Dot, R, NT>(w, i, x, t, out, ahead);
  }
};

}  // namespace
}  // namespace cascade::linear::detail::avx512_vnni
CASCADE_TARGET_END
#endif  // CASCADE_X86
