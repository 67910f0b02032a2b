// Many rows of X on AMX int8 tiles (AMX-TILE and AMX-INT8: Sapphire Rapids and later Xeons), for the avx512-vnni
// tier (linear_avx512.cpp). A tdpbsud multiplies a 16 x 64-byte tile of signed bytes by a 16 x 64-byte tile of
// unsigned ones into 16 x 16 int32 sums, 16,384 multiply-adds per instruction.
//
// Per block of 16 weight rows, the codes are unpacked once into B (n_in / 4 rows of 64 bytes: row k / 4 holds
// codes k .. k + 3 of the 16 weight rows, row j in bytes 4j .. 4j + 3), the layout a B tile takes. Then per 16
// rows of X and per group g of K: C = A_g B_g (A_g: the 16 rows' G codes of the group, read from the activations
// in place), one integer sum per row of X and weight row, exactly what the vector kernel's lanes hold; C goes to
// a 1 KB buffer in L1, and row m of it (16 weight rows in the lanes; the folded offset added, offset_codes)
// meets the group's scales as linear.hpp's order says, on the same f32 operations as linear_block16.inc. So a row of X gives the same bits on tiles as on
// vectors. Rows of X past the last whole 16 go to the vector kernel.
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
// tile load reads memory (so it could move the stores that made A or B past it). tmm0 = A (16 rows x G bytes),
// tmm1 = B (G / 4 rows x 64 bytes), tmm2 = C (16 x 16 int32), palette 1.
class AmxTiles {
 public:
  explicit AmxTiles(int G) {
    struct alignas(64) {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t colsb[16] = {};
      uint8_t rows[16] = {};
    } cfg;
    cfg.colsb[0] = uint16_t(G), cfg.rows[0] = 16;
    cfg.colsb[1] = 64, cfg.rows[1] = uint8_t(G / 4);
    cfg.colsb[2] = 64, cfg.rows[2] = 16;
    __asm__ volatile("ldtilecfg\t%0" ::"m"(cfg));
  }
  ~AmxTiles() { __asm__ volatile("tilerelease" ::: "memory"); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
  // c (16 x 16 int32, row m of X at c + 16 m) = a (16 rows of G signed bytes, a_stride apart) times b (G / 4 rows
  // of 64 unsigned bytes).
  void product(const int8_t* a, int64_t a_stride, const uint8_t* b, int32_t* c) const {
    __asm__ volatile(
        "{tileloadd\t(%0,%1,1), %%tmm0|tileloadd\t%%tmm0, [%0+%1*1]}\n\t"
        "{tileloadd\t(%2,%3,1), %%tmm1|tileloadd\t%%tmm1, [%2+%3*1]}\n\t"
        "tilezero\t%%tmm2\n\t"
        "{tdpbsud\t%%tmm1, %%tmm0, %%tmm2|tdpbsud\t%%tmm2, %%tmm0, %%tmm1}\n\t"
        "{tilestored\t%%tmm2, (%4,%3,1)|tilestored\t[%4+%3*1], %%tmm2}" ::"r"(a),
        "r"(a_stride), "r"(b), "r"(int64_t(64)), "r"(c)
        : "memory");
  }
};
#endif

// AmxTiles' products in plain C++.
class AmxEmulated {
 public:
  explicit AmxEmulated(int G) : G_(G) {}
  void product(const int8_t* a, int64_t a_stride, const uint8_t* b, int32_t* c) const {
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

// out[m * 16 + l] = Y[t0 + m, row l of the block] for the 16 rows of X from t0: the block's scales at wb, its
// codes unpacked at b, each group's sums from ops.
template <class Ops, TensorType T>
void amx_tile(const Ops& ops, const uint8_t* wb, const uint8_t* b, const Int8Form& x, int64_t t0, float* out) {
  using P = Block16<V512, T>;
  constexpr int G = P::G, NG = P::kValues / G;
  const int64_t K = x.n_in, nb = K / 32, ng = K / G;
  const int8_t* xq = x.q.data() + t0 * K;
  const float* xd = x.d.data() + t0 * nb;
  const float* xs = (G == 16 ? x.s16.data() : x.s32.data()) + t0 * ng;
  const int32_t* xqs = (G == 16 ? x.qs16.data() : x.qs32.data()) + t0 * ng;
  alignas(64) int32_t c[16 * 16];
  __m512 acc[kAmxTile];
  for (int m = 0; m < kAmxTile; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < K / P::kValues; ++blk) {
    const P p(wb + blk * 16 * P::kBlockBytes, 0);
    for (int g = 0; g < NG; ++g) {
      const int64_t k0 = blk * P::kValues + g * G, gg = blk * NG + g;
      ops.product(xq + k0, K, b + 16 * k0, c);
      __m512 scale, offset;
      p.group(g, scale, offset);
      for (int m = 0; m < kAmxTile; ++m) {
        __m512i s = _mm512_load_si512(c + 16 * m);
        if constexpr (offset_codes(T) != 0) s = _mm512_add_epi32(s, _mm512_set1_epi32(offset_codes(T) * xqs[m * ng + gg]));
        const __m512 cm = _mm512_mul_ps(scale, _mm512_set1_ps(xd[m * nb + k0 / 32]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), cm, acc[m]);
        if constexpr (offset_codes(T) == 0) acc[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xs[m * ng + gg]), acc[m]);
      }
    }
  }
  for (int m = 0; m < kAmxTile; ++m) _mm512_storeu_ps(out + 16 * m, acc[m]);
}

// Y[t, i] for t in [t0, t1), i in [i0, i1) (i0 a multiple of 16): whole tiles of 16 rows of X on tiles (Ops), the
// rest on the vector kernel (NT rows of X a tile).
template <class Ops, TensorType T, int NT>
void rows_amx(const Matrix& w, const Int8Form& x, int64_t i0, int64_t i1, int64_t t0, int64_t t1, float* y) {
  const int64_t ta = t0 + (t1 - t0) / kAmxTile * kAmxTile;
  if (ta > t0) {
    const Ops ops(Block16<V512, T>::G);
    thread_local std::vector<uint8_t> scratch, b;
    if (scratch.size() < 16 * w.row_bytes) scratch.resize(16 * w.row_bytes);
    if (b.size() < size_t(16 * w.n_in)) b.resize(size_t(16 * w.n_in));
    alignas(64) float out[kAmxTile * 16];
    for (int64_t i = i0; i < i1; i += 16) {
      const uint8_t* wb = block_at(w, i, scratch.data());
      unpack_b<T>(wb, w.n_in, b.data());
      const int n_rows = int(std::min<int64_t>(16, w.n_out - i));
      for (int64_t t = t0; t < ta; t += kAmxTile) {
        amx_tile<Ops, T>(ops, wb, b.data(), x, t, out);
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
