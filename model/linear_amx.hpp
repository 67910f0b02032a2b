// Many rows of X on AMX int8 tiles (AMX-TILE and AMX-INT8: Sapphire Rapids and later Xeons), for the avx512-vnni
// tier (linear_avx512.cpp). A tdpbsud multiplies a 16 x 64-byte tile of signed bytes by a 16 x 64-byte tile of
// unsigned ones into 16 x 16 int32 sums, 16,384 multiply-adds per instruction.
//
// Per block of 16 weight rows, the codes are unpacked once into B (n_in / 4 rows of 64 bytes: row k / 4 holds
// codes k .. k + 3 of the 16 weight rows, row j in bytes 4j .. 4j + 3), the layout a B tile takes. The codes of
// each 16 rows of X are packed by group (pack_a: A_g, the 16 rows' G codes of group g, contiguous), and their
// per-row terms beside them (pack_terms). Then per 16 rows of X and per group g: C = A_g B_g, one integer sum per
// row of X and weight row, exactly what the vector kernel's lanes hold; C goes to a buffer in L1, and row m of it
// (16 weight rows in the lanes; the folded offset added, offset_codes) meets the group's scales as linear.hpp's
// order says, on the same f32 operations as linear_block16.inc. So a row of X gives the same bits on tiles as on
// vectors. Rows of X past the last whole 16 go to the vector kernel.
//
// Each group's product is issued three groups ahead of its scales, on one of four tile sets, so that the tile unit
// works while the vector units apply earlier groups' scales. On 2 cores of a Xeon with AMX (docs/study.md section
// 28) this runs 1.1-1.4x the vector kernel from 64 rows of X on, about 670 GOP/s: the tile loads and stores and
// the scales' vector work (16 rows x a convert, a multiply and one or two FMAs per group) still take turns more
// than they overlap, far below the tiles' peak.
//
// Tiles are per-thread state: each call loads the tile configuration and releases the tiles when it returns. The
// OS must grant a process the tile data; linear::amx_int8_usable() asks (cascade::amx_usable()) and the tiles
// are used only where it was granted. AmxEmulated runs the same driver with its products in plain C++, so that
// tests check the driver on any CPU.
#pragma once

#include "model/linear_avx512.hpp"

#if CASCADE_X86
CASCADE_LINEAR_TARGET_AVX512_VNNI_BEGIN
namespace cascade::linear::detail::avx512_vnni {
namespace {  // internal linkage, as linear_x86.inc

// Rows of X a tile: the 16 rows of an A tile, whose sums stay in 16 registers.
inline constexpr int64_t kAmxTile = 16;

#if defined(__x86_64__)
// The tiles of one call, in asm: the compiler's intrinsics need the AMX target options and do not tell it that a
// tile load reads memory (so it could move the stores that made A or B past it). Palette 1; tmm0, tmm1 = A (16
// rows x G bytes), tmm2, tmm3 = B (G / 4 rows x 64 bytes), tmm4 .. tmm7 = C (16 x 16 int32).
class AmxTiles {
 public:
  explicit AmxTiles(int G) {
    struct alignas(64) {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t colsb[16] = {};
      uint8_t rows[16] = {};
    } cfg;
    for (int t = 0; t < 2; ++t) cfg.colsb[t] = uint16_t(G), cfg.rows[t] = 16;
    for (int t = 2; t < 4; ++t) cfg.colsb[t] = 64, cfg.rows[t] = uint8_t(G / 4);
    for (int t = 4; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    __asm__ volatile("ldtilecfg\t%0" ::"m"(cfg));
  }
  ~AmxTiles() { __asm__ volatile("tilerelease" ::: "memory"); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;

// One group's product: A from %0 + AOFF (rows %1 apart) into tmm<A>, B from %2 + BOFF (rows 64 apart) into
// tmm<B>, then C = A B in tmm<C> (AT&T lists the operands in reverse: B, A, C). STORE: tmm<C> to %4 + COFF.
#define CASCADE_AMX_GROUP(A, B, C, AOFF, BOFF)                                                      \
  "{tileloadd\t" AOFF "(%0,%1,1), %%tmm" A "|tileloadd\t%%tmm" A ", [%0+%1*1+" AOFF "]}\n\t"    \
  "{tileloadd\t" BOFF "(%2,%3,1), %%tmm" B "|tileloadd\t%%tmm" B ", [%2+%3*1+" BOFF "]}\n\t"    \
  "tilezero\t%%tmm" C "\n\t"                                                                     \
  "{tdpbsud\t%%tmm" B ", %%tmm" A ", %%tmm" C "|tdpbsud\t%%tmm" C ", %%tmm" A ", %%tmm" B "}\n\t"
#define CASCADE_AMX_STORE(C, COFF) \
  "{tilestored\t%%tmm" C ", " COFF "(%4,%3,1)|tilestored\t[%4+%3*1+" COFF "], %%tmm" C "}\n\t"
#define CASCADE_AMX_OPERANDS \
  "r"(a), "r"(a_stride), "r"(b), "r"(int64_t(64)), "r"(c) : "memory"

  // c (16 x 16 int32, row m of X at c + 16 m) = a (16 rows of G signed bytes, a_stride apart) times b (G / 4 rows
  // of 64 unsigned bytes), on tile set k (0..3): A in tmm(k % 2), B in tmm(2 + k % 2), C in tmm(4 + k), so that
  // the products of consecutive groups (k = g % 4) need not wait for each other's tiles.
  void product_on(int k, const int8_t* a, int64_t a_stride, const uint8_t* b, int32_t* c) const {
    switch (k) {
      case 0:
        __asm__ volatile(CASCADE_AMX_GROUP("0", "2", "4", "0", "0") CASCADE_AMX_STORE("4", "0")::CASCADE_AMX_OPERANDS);
        break;
      case 1:
        __asm__ volatile(CASCADE_AMX_GROUP("1", "3", "5", "0", "0") CASCADE_AMX_STORE("5", "0")::CASCADE_AMX_OPERANDS);
        break;
      case 2:
        __asm__ volatile(CASCADE_AMX_GROUP("0", "2", "6", "0", "0") CASCADE_AMX_STORE("6", "0")::CASCADE_AMX_OPERANDS);
        break;
      default:
        __asm__ volatile(CASCADE_AMX_GROUP("1", "3", "7", "0", "0") CASCADE_AMX_STORE("7", "0")::CASCADE_AMX_OPERANDS);
        break;
    }
  }
#undef CASCADE_AMX_GROUP
#undef CASCADE_AMX_STORE
#undef CASCADE_AMX_OPERANDS
};
#endif

// AmxTiles' products in plain C++.
class AmxEmulated {
 public:
  explicit AmxEmulated(int G) : G_(G) {}
  void product_on(int, const int8_t* a, int64_t a_stride, const uint8_t* b, int32_t* c) const {
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        int32_t s = 0;
        for (int kk = 0; kk < G_ / 4; ++kk)
          for (int e = 0; e < 4; ++e) s += int32_t(a[m * a_stride + 4 * kk + e]) * int32_t(b[64 * kk + 4 * n + e]);
        c[16 * m + n] = s;
      }
  }

 private:
  int G_;
};

// The block of 16 rows at wb (rows16 layout) unpacked into b (n_in / 4 rows of 64 bytes).
template <TensorType T>
void unpack_b(const uint8_t* wb, int64_t n_in, uint8_t* b) {
  using P = Block16<V512, T>;
  for (int64_t blk = 0; blk < n_in / P::kValues; ++blk) {
    const P p(wb + blk * 16 * P::kBlockBytes, 0);
    for (int g = 0; g < P::kValues / P::G; ++g) {
      const int64_t k0 = blk * P::kValues + g * P::G;
      unroll<P::kChunks>([&]<int c>() {
        __m512i lo, hi;
        p.template codes<c>(g, lo, hi);
        if constexpr (P::kNibbles) {
          _mm512_storeu_si512(b + 16 * (k0 + 8 * c), lo);
          _mm512_storeu_si512(b + 16 * (k0 + 8 * c + 4), hi);
        } else {
          _mm512_storeu_si512(b + 16 * (k0 + 4 * c), lo);
        }
      });
    }
  }
}

// The codes of the 16 rows of X from t0 packed by group into a (n_in / G tiles of 16 rows x G bytes, each
// contiguous), so that a tile load reads 16 G consecutive bytes: read in place, rows n_in bytes apart, a tile's
// rows fell in few cache sets and the loads waited on L1's misses.
template <int G>
void pack_a(const Int8Form& x, int64_t t0, int8_t* a) {
  const int64_t K = x.n_in;
  for (int64_t gg = 0; gg < K / G; ++gg)
    for (int m = 0; m < 16; ++m) std::memcpy(a + (gg * 16 + m) * G, x.q.data() + (t0 + m) * K + gg * G, G);
}

// The per-row terms of the 16 rows of X from t0, by group: d[k / 32][m], the scale of row t0 + m's block of 32
// codes; s[g][m], its sum of values over group g (the types whose offsets stand apart); qs[g][m], its sum of codes
// over the group times offset_codes (the others). Each group's 16 values lie together, so that the scales' loop
// broadcasts them from one pointer, not from 16 rows' pointers that the registers cannot all hold.
struct AmxRowTerms {
  std::vector<float> d, s;
  std::vector<int32_t> qs;
};

template <TensorType T, int G>
void pack_terms(const Int8Form& x, int64_t t0, AmxRowTerms& r) {
  const int64_t K = x.n_in, nb = K / 32, ng = K / G;
  r.d.resize(size_t(nb * 16));
  for (int m = 0; m < 16; ++m)
    for (int64_t k = 0; k < nb; ++k) r.d[size_t(k * 16 + m)] = x.d[size_t((t0 + m) * nb + k)];
  const float* xs = G == 16 ? x.s16.data() : x.s32.data();
  const int32_t* xqs = G == 16 ? x.qs16.data() : x.qs32.data();
  if constexpr (offset_codes(T) == 0) {
    r.s.resize(size_t(ng * 16));
    for (int m = 0; m < 16; ++m)
      for (int64_t g = 0; g < ng; ++g) r.s[size_t(g * 16 + m)] = xs[(t0 + m) * ng + g];
  } else {
    r.qs.resize(size_t(ng * 16));
    for (int m = 0; m < 16; ++m)
      for (int64_t g = 0; g < ng; ++g) r.qs[size_t(g * 16 + m)] = offset_codes(T) * xqs[(t0 + m) * ng + g];
  }
}

// out[m * 16 + l] = Y[t0 + m, row l of the block] for the 16 rows of X from t0: the block's scales at wb, its
// codes unpacked at b, the rows' codes packed at a (pack_a) and their terms in r (pack_terms), each group's sums
// from ops.
template <class Ops, TensorType T>
void amx_tile(const Ops& ops, const uint8_t* wb, const uint8_t* b, const int8_t* a, const AmxRowTerms& r,
              int64_t K, float* out) {
  using P = Block16<V512, T>;
  constexpr int G = P::G, NG = P::kValues / G;
  static_assert(G == 16 || G == 32);
  const int64_t ng = K / G;
  alignas(64) int32_t c[8][16 * 16];  // the C of group g in c[g % 8]
  __m512 acc[kAmxTile];
  for (int m = 0; m < kAmxTile; ++m) acc[m] = _mm512_setzero_ps();
  // Group gg's C at c_g meets its scales, in linear.hpp's order, in every row's sum.
  const auto scales = [&](int64_t gg, const int32_t* c_g) __attribute__((always_inline)) {
    const P p(wb + gg / NG * 16 * P::kBlockBytes, 0);
    const int64_t k0 = gg * G;
    __m512 scale, offset;
    p.group(int(gg % NG), scale, offset);
    const float* d = r.d.data() + k0 / 32 * 16;
    const float* s_g = offset_codes(T) == 0 ? r.s.data() + gg * 16 : nullptr;
    const int32_t* qs_g = offset_codes(T) != 0 ? r.qs.data() + gg * 16 : nullptr;
#pragma GCC unroll 16
    for (int m = 0; m < kAmxTile; ++m) {  // unrolled, so that acc stays in registers
      __m512i s = _mm512_load_si512(c_g + 16 * m);
      if constexpr (offset_codes(T) != 0) s = _mm512_add_epi32(s, _mm512_set1_epi32(qs_g[m]));
      const __m512 cm = _mm512_mul_ps(scale, _mm512_set1_ps(d[m]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), cm, acc[m]);
      if constexpr (offset_codes(T) == 0) acc[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(s_g[m]), acc[m]);
    }
  };
  // Group g's product is issued L groups ahead of its scales, on the tiles of g % 4: the tile unit works ahead
  // while the vector units apply earlier groups' scales, and a C is read long after its tile store landed (read
  // right after it, it was read before the store had landed, and the core started over). L = 3 against 4 groups
  // issued together: 1,231 rows of the 1B-shaped prefill 5.31 s -> 4.90 s, alternated 3 times (L = 2 and 5: within
  // the noise of 3).
  constexpr int64_t L = 3;
  const auto product = [&](int64_t g) { ops.product_on(int(g % 4), a + 16 * g * G, G, b + 16 * g * G, c[g % 8]); };
  for (int64_t g = 0; g < std::min(L, ng); ++g) product(g);
  for (int64_t g = 0; g < ng; ++g) {
    if (g + L < ng) product(g + L);
    scales(g, c[g % 8]);
  }
  for (int m = 0; m < kAmxTile; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

// Y[t, i] for t in [t0, t1), i in [i0, i1) (i0 a multiple of 16): whole tiles of 16 rows of X on tiles (Ops), the
// rest on the vector kernel (NT rows of X a tile).
template <class Ops, TensorType T, int NT>
void rows_amx(const Matrix& w, const Int8Form& x, int64_t i0, int64_t i1, int64_t t0, int64_t t1, float* y) {
  const int64_t ta = t0 + (t1 - t0) / kAmxTile * kAmxTile;
  if (ta > t0) {
    constexpr int G = Block16<V512, T>::G;
    const Ops ops(G);
    thread_local std::vector<uint8_t> scratch, b;
    thread_local std::vector<int8_t> a;
    thread_local std::vector<AmxRowTerms> terms;
    if (terms.size() < size_t((ta - t0) / kAmxTile)) terms.resize(size_t((ta - t0) / kAmxTile));
    if (scratch.size() < 16 * w.row_bytes) scratch.resize(16 * w.row_bytes);
    if (b.size() < size_t(16 * w.n_in)) b.resize(size_t(16 * w.n_in));
    if (a.size() < size_t((ta - t0) * w.n_in)) a.resize(size_t((ta - t0) * w.n_in));
    for (int64_t t = t0; t < ta; t += kAmxTile) {
      pack_a<G>(x, t, a.data() + (t - t0) * w.n_in);
      pack_terms<T, G>(x, t, terms[size_t((t - t0) / kAmxTile)]);
    }
    alignas(64) float out[kAmxTile * 16];
    for (int64_t i = i0; i < i1; i += 16) {
      const uint8_t* wb = block_at(w, i, scratch.data());
      unpack_b<T>(wb, w.n_in, b.data());
      const int n_rows = int(std::min<int64_t>(16, w.n_out - i));
      for (int64_t t = t0; t < ta; t += kAmxTile) {
        amx_tile<Ops, T>(ops, wb, b.data(), a.data() + (t - t0) * w.n_in, terms[size_t((t - t0) / kAmxTile)],
                         w.n_in, out);
        for (int m = 0; m < kAmxTile; ++m)
          std::memcpy(y + (t + m) * w.n_out + i, out + 16 * m, size_t(n_rows) * sizeof(float));
      }
    }
  }
  if (ta < t1) rows_block16<V512, Dot, T, false, NT>(w, x, i0, i1, ta, t1, y);
}

}  // namespace
}  // namespace cascade::linear::detail::avx512_vnni
CASCADE_TARGET_END
#endif  // CASCADE_X86
