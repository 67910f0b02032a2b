#include "model/quant.hpp"

#include <bit>
#include <cmath>
#include <cstring>

#include "cascade/error.hpp"

namespace cascade::gguf {

// --- scalar conversions --------------------------------------------------------------------------

float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24, exact in f32
    const float v = static_cast<float>(mant) * 0x1p-24f;
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));  // inf or NaN
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));          // rebias 15 -> 127
}

uint16_t fp32_to_fp16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((ax >> 13) & 0x3ffu);  // NaN, quiet
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (ax < 0x38800000u) {
    // below the smallest normal half (2^-14): a subnormal mant * 2^-24; scaling by 2^24 is exact and
    // nearbyint rounds half to even in the default rounding mode
    const float scaled = std::bit_cast<float>(ax) * 0x1p24f;
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  uint32_t h = (((ax >> 23) - 112) << 10) | ((ax >> 13) & 0x3ffu);
  const uint32_t rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is correct
  return sign | static_cast<uint16_t>(h);
}

float bf16_to_fp32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

uint16_t fp32_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN, quiet
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

namespace {

uint16_t le16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
float half_at(const uint8_t* p) { return fp16_to_fp32(le16(p)); }

// --- one block each, as codes: b points at the block; q receives block_size codes, sc and off one scale and
// offset per group (quant.hpp) ---

void scales_q4_0(const uint8_t* b, float* sc, float* off) {
  sc[0] = half_at(b);
  off[0] = -8.0f * sc[0];
}

void codes_q4_0(const uint8_t* b, uint8_t* q, float* sc, float* off) {
  scales_q4_0(b, sc, off);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    q[j] = qs[j] & 15;
    q[j + 16] = qs[j] >> 4;
  }
}

void scales_q4_1(const uint8_t* b, float* sc, float* off) {
  sc[0] = half_at(b);
  off[0] = half_at(b + 2);
}

void codes_q4_1(const uint8_t* b, uint8_t* q, float* sc, float* off) {
  scales_q4_1(b, sc, off);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    q[j] = qs[j] & 15;
    q[j + 16] = qs[j] >> 4;
  }
}

void scales_q8_0(const uint8_t* b, float* sc, float* off) {
  sc[0] = half_at(b);
  off[0] = -128.0f * sc[0];
}

void codes_q8_0(const uint8_t* b, uint8_t* q, float* sc, float* off) {
  scales_q8_0(b, sc, off);
  for (int j = 0; j < 32; ++j) q[j] = static_cast<uint8_t>(b[2 + j] ^ 0x80);  // two's complement + 128
}

// The 12 scale bytes of q4_K and q5_K hold eight 6-bit scales and eight 6-bit mins, one pair per sub-block
// of 32. Sub-blocks 0-3 keep theirs in the low 6 bits of bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7
// keep their low 4 bits in the nibbles of bytes 8-11 (scale low, min high) and their top 2 bits in the
// top 2 bits of bytes 0-3 (scale) and 4-7 (min).
void scale_min_k4(int sub, const uint8_t* s, int& scale, int& min) {
  if (sub < 4) {
    scale = s[sub] & 63;
    min = s[sub + 4] & 63;
  } else {
    scale = (s[sub + 4] & 15) | ((s[sub - 4] >> 6) << 4);
    min = (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4);
  }
}

void scales_k4(const uint8_t* b, float* sc, float* off) {
  const float d = half_at(b), dmin = half_at(b + 2);
  for (int sub = 0; sub < 8; ++sub) {
    int scale, min;
    scale_min_k4(sub, b + 4, scale, min);
    sc[sub] = d * static_cast<float>(scale);
    off[sub] = -dmin * static_cast<float>(min);
  }
}

// q4_K: four groups of 64 values; group g reads qs[32g .. 32g+32): the low nibbles are sub-block 2g,
// the high nibbles sub-block 2g+1.
void codes_q4_k(const uint8_t* b, uint8_t* q, float* sc, float* off) {
  scales_k4(b, sc, off);
  const uint8_t* qs = b + 16;
  for (int g = 0; g < 4; ++g)
    for (int l = 0; l < 32; ++l) {
      q[64 * g + l] = qs[32 * g + l] & 15;
      q[64 * g + 32 + l] = qs[32 * g + l] >> 4;
    }
}

// q5_K: q4_K plus a fifth bit per value from qh[32]: for value 64g + l it is bit 2g of qh[l], for
// 64g + 32 + l bit 2g+1.
void codes_q5_k(const uint8_t* b, uint8_t* q, float* sc, float* off) {
  scales_k4(b, sc, off);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int g = 0; g < 4; ++g)
    for (int l = 0; l < 32; ++l) {
      q[64 * g + l] = static_cast<uint8_t>((qs[32 * g + l] & 15) | (((qh[l] >> (2 * g)) & 1) << 4));
      q[64 * g + 32 + l] = static_cast<uint8_t>((qs[32 * g + l] >> 4) | (((qh[l] >> (2 * g + 1)) & 1) << 4));
    }
}

// q6_K: two halves of 128 values; half h uses ql[64h .. 64h+64), qh[32h .. 32h+32), scales[8h .. 8h+8).
// Within a half, for l < 32: value l takes the low nibble of ql[l] and bits 0-1 of qh[l]; value 32+l the
// low nibble of ql[32+l] and bits 2-3; value 64+l the high nibble of ql[l] and bits 4-5; value 96+l the
// high nibble of ql[32+l] and bits 6-7. Each run of 16 values has its own scale.
void scales_q6_k(const uint8_t* b, float* sc, float* off) {
  const float d = half_at(b + 208);
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  for (int g = 0; g < 16; ++g) {
    sc[g] = d * static_cast<float>(scales[g]);
    off[g] = -32.0f * sc[g];
  }
}

void codes_q6_k(const uint8_t* b, uint8_t* q, float* sc, float* off) {
  scales_q6_k(b, sc, off);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    uint8_t* out = q + 128 * h;
    for (int l = 0; l < 32; ++l) {
      out[l] = static_cast<uint8_t>((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4));
      out[l + 32] = static_cast<uint8_t>((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
      out[l + 64] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
      out[l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
    }
  }
}

using CodesFn = void (*)(const uint8_t*, uint8_t*, float*, float*);
using ScalesFn = void (*)(const uint8_t*, float*, float*);

ScalesFn scales_fn(TensorType t) {
  switch (t) {
    case TensorType::Q4_0: return scales_q4_0;
    case TensorType::Q4_1: return scales_q4_1;
    case TensorType::Q8_0: return scales_q8_0;
    case TensorType::Q4_K: case TensorType::Q5_K: return scales_k4;
    case TensorType::Q6_K: return scales_q6_k;
    default: return nullptr;
  }
}

CodesFn codes_fn(TensorType t) {
  switch (t) {
    case TensorType::Q4_0: return codes_q4_0;
    case TensorType::Q4_1: return codes_q4_1;
    case TensorType::Q8_0: return codes_q8_0;
    case TensorType::Q4_K: return codes_q4_k;
    case TensorType::Q5_K: return codes_q5_k;
    case TensorType::Q6_K: return codes_q6_k;
    default: return nullptr;
  }
}

// y = scale * code + offset per group of one block, rounded once (the product is exact, quant.hpp).
void block_values(TensorType t, const uint8_t* b, float* y) {
  uint8_t q[256];
  float sc[16], off[16];
  codes_fn(t)(b, q, sc, off);
  const int64_t bs = block_size(t), gs = code_group_size(t);
  // Group by group, so the inner loop has one scale and offset and vectorizes (the f32 path decodes every weight
  // of a matrix per product: this loop is most of its time).
  for (int64_t g = 0; g < bs / gs; ++g) {
    const float s = sc[g], o = off[g];
    const uint8_t* qg = q + g * gs;
    float* yg = y + g * gs;
    for (int64_t k = 0; k < gs; ++k) yg[k] = std::fma(s, static_cast<float>(qg[k]), o);
  }
}

void check_args(TensorType t, int64_t n, const char* fn) {
  CASCADE_CHECK(can_dequantize(t), fn, ": tensor type ", type_name(t), " (", static_cast<uint32_t>(t),
                ") is not supported");
  const int64_t bs = block_size(t);
  CASCADE_CHECK(n >= 0 && n % bs == 0, fn, ": ", n, " values of type ", type_name(t),
                " are not a whole number of blocks of ", bs);
}

// Sum of y[k] * x[k] over k < n, in 8 independent lanes so the compiler can vectorize it.
float dot_f32(const float* y, const float* x, int64_t n) {
  float acc[8] = {};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int j = 0; j < 8; ++j) acc[j] += y[k + j] * x[k + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; k < n; ++k) s += y[k] * x[k];
  return s;
}

}  // namespace

bool can_dequantize(TensorType t) {
  switch (t) {
    case TensorType::F32: case TensorType::F16: case TensorType::BF16:
    case TensorType::Q8_0: case TensorType::Q4_0: case TensorType::Q4_1:
    case TensorType::Q4_K: case TensorType::Q5_K: case TensorType::Q6_K:
      return true;
    default:
      return false;
  }
}

void dequantize_row(TensorType t, const void* src, float* dst, int64_t n) {
  check_args(t, n, "dequantize_row");
  const auto* b = static_cast<const uint8_t*>(src);
  switch (t) {
    case TensorType::F32:
      std::memcpy(dst, b, static_cast<size_t>(n) * sizeof(float));
      return;
    case TensorType::F16:
      for (int64_t k = 0; k < n; ++k) dst[k] = fp16_to_fp32(le16(b + 2 * k));
      return;
    case TensorType::BF16:
      for (int64_t k = 0; k < n; ++k) dst[k] = bf16_to_fp32(le16(b + 2 * k));
      return;
    default: break;
  }
  const int64_t bs = block_size(t);
  const uint64_t bb = block_bytes(t);
  for (int64_t k = 0; k < n / bs; ++k) block_values(t, b + k * bb, dst + k * bs);
}

int64_t code_group_size(TensorType t) {
  switch (t) {
    case TensorType::Q4_0: case TensorType::Q4_1: case TensorType::Q8_0: case TensorType::Q4_K:
    case TensorType::Q5_K:
      return 32;
    case TensorType::Q6_K:
      return 16;
    default:
      return 0;
  }
}

void decode_codes(TensorType t, const void* src, int64_t n, uint8_t* code, float* scale, float* offset) {
  check_args(t, n, "decode_codes");
  const CodesFn fn = codes_fn(t);
  CASCADE_CHECK(fn != nullptr, "decode_codes: tensor type ", type_name(t), " has no integer codes");
  const auto* b = static_cast<const uint8_t*>(src);
  const int64_t bs = block_size(t), n_groups = bs / code_group_size(t);
  const uint64_t bb = block_bytes(t);
  for (int64_t k = 0; k < n / bs; ++k) fn(b + k * bb, code + k * bs, scale + k * n_groups, offset + k * n_groups);
}

void block_scales(TensorType t, const void* src, float* scale, float* offset) {
  const ScalesFn fn = scales_fn(t);
  CASCADE_CHECK(fn != nullptr, "block_scales: tensor type ", type_name(t), " has no integer codes");
  fn(static_cast<const uint8_t*>(src), scale, offset);
}

float dot_row(TensorType t, const void* row, const float* x, int64_t n) {
  check_args(t, n, "dot_row");
  const auto* b = static_cast<const uint8_t*>(row);
  if (t == TensorType::F32) {
    float tmp[256];
    float s = 0;
    for (int64_t k = 0; k < n; k += 256) {
      const int64_t m = n - k < 256 ? n - k : 256;
      std::memcpy(tmp, b + 4 * k, static_cast<size_t>(m) * sizeof(float));  // the row may be unaligned
      s += dot_f32(tmp, x + k, m);
    }
    return s;
  }
  if (t == TensorType::F16 || t == TensorType::BF16) {
    float tmp[256];
    float s = 0;
    for (int64_t k = 0; k < n; k += 256) {
      const int64_t m = n - k < 256 ? n - k : 256;
      dequantize_row(t, b + 2 * k, tmp, m);
      s += dot_f32(tmp, x + k, m);
    }
    return s;
  }
  const int64_t bs = block_size(t);
  const uint64_t bb = block_bytes(t);
  float tmp[256];
  float s = 0;
  for (int64_t k = 0; k < n / bs; ++k) {
    block_values(t, b + k * bb, tmp);
    s += dot_f32(tmp, x + k * bs, bs);
  }
  return s;
}

void widen_q5_0_to_q8_0(const void* src, void* dst, int64_t n_blocks) {
  CASCADE_CHECK(n_blocks >= 0, "widen_q5_0_to_q8_0: ", n_blocks, " blocks");
  const auto* in = static_cast<const uint8_t*>(src);
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t k = 0; k < n_blocks; ++k, in += 22, out += 34) {
    const uint32_t qh = uint32_t(in[2]) | uint32_t(in[3]) << 8 | uint32_t(in[4]) << 16 | uint32_t(in[5]) << 24;
    out[0] = in[0];  // d, the same f16
    out[1] = in[1];
    for (int j = 0; j < 16; ++j) {
      const int lo = (in[6 + j] & 0x0f) | int((qh >> j) & 1u) << 4;
      const int hi = (in[6 + j] >> 4) | int((qh >> (j + 16)) & 1u) << 4;
      out[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(lo - 16));
      out[2 + 16 + j] = static_cast<uint8_t>(static_cast<int8_t>(hi - 16));
    }
  }
}

}  // namespace cascade::gguf
