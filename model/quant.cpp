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

// --- one block each: b points at the block, y receives block_size values ---

void block_q4_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 15) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void block_q4_1(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const float m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 15) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

void block_q8_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const auto* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
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

// q4_K: four groups of 64 values; group g reads qs[32g .. 32g+32): the low nibbles are sub-block 2g,
// the high nibbles sub-block 2g+1.
void block_q4_k(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const float dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qs = b + 16;
  for (int g = 0; g < 4; ++g) {
    int sc, mn;
    scale_min_k4(2 * g, scales, sc, mn);
    const float d_lo = d * static_cast<float>(sc), m_lo = dmin * static_cast<float>(mn);
    scale_min_k4(2 * g + 1, scales, sc, mn);
    const float d_hi = d * static_cast<float>(sc), m_hi = dmin * static_cast<float>(mn);
    const uint8_t* q = qs + 32 * g;
    float* out = y + 64 * g;
    for (int l = 0; l < 32; ++l) {
      out[l] = d_lo * static_cast<float>(q[l] & 15) - m_lo;
      out[l + 32] = d_hi * static_cast<float>(q[l] >> 4) - m_hi;
    }
  }
}

// q5_K: q4_K plus a fifth bit per value from qh[32]: for value 64g + l it is bit 2g of qh[l], for
// 64g + 32 + l bit 2g+1.
void block_q5_k(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const float dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int g = 0; g < 4; ++g) {
    int sc, mn;
    scale_min_k4(2 * g, scales, sc, mn);
    const float d_lo = d * static_cast<float>(sc), m_lo = dmin * static_cast<float>(mn);
    scale_min_k4(2 * g + 1, scales, sc, mn);
    const float d_hi = d * static_cast<float>(sc), m_hi = dmin * static_cast<float>(mn);
    const uint8_t* q = qs + 32 * g;
    float* out = y + 64 * g;
    for (int l = 0; l < 32; ++l) {
      const int lo = (q[l] & 15) | (((qh[l] >> (2 * g)) & 1) << 4);
      const int hi = (q[l] >> 4) | (((qh[l] >> (2 * g + 1)) & 1) << 4);
      out[l] = d_lo * static_cast<float>(lo) - m_lo;
      out[l + 32] = d_hi * static_cast<float>(hi) - m_hi;
    }
  }
}

// q6_K: two halves of 128 values; half h uses ql[64h .. 64h+64), qh[32h .. 32h+32), scales[8h .. 8h+8).
// Within a half, for l < 32: value l takes the low nibble of ql[l] and bits 0-1 of qh[l]; value 32+l the
// low nibble of ql[32+l] and bits 2-3; value 64+l the high nibble of ql[l] and bits 4-5; value 96+l the
// high nibble of ql[32+l] and bits 6-7. Each run of 16 values has its own scale.
void block_q6_k(const uint8_t* b, float* y) {
  const float d = half_at(b + 208);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * h);
    float* out = y + 128 * h;
    for (int l = 0; l < 32; ++l) {
      const int s = l / 16;
      const int q0 = ((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q1 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q2 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q3 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      out[l] = d * static_cast<float>(sc[s]) * static_cast<float>(q0);
      out[l + 32] = d * static_cast<float>(sc[s + 2]) * static_cast<float>(q1);
      out[l + 64] = d * static_cast<float>(sc[s + 4]) * static_cast<float>(q2);
      out[l + 96] = d * static_cast<float>(sc[s + 6]) * static_cast<float>(q3);
    }
  }
}

using BlockFn = void (*)(const uint8_t*, float*);

BlockFn block_fn(TensorType t) {
  switch (t) {
    case TensorType::Q4_0: return block_q4_0;
    case TensorType::Q4_1: return block_q4_1;
    case TensorType::Q8_0: return block_q8_0;
    case TensorType::Q4_K: return block_q4_k;
    case TensorType::Q5_K: return block_q5_k;
    case TensorType::Q6_K: return block_q6_k;
    default: return nullptr;
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
  const BlockFn fn = block_fn(t);
  const int64_t bs = block_size(t);
  const uint64_t bb = block_bytes(t);
  for (int64_t k = 0; k < n / bs; ++k) fn(b + k * bb, dst + k * bs);
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
  const BlockFn fn = block_fn(t);
  const int64_t bs = block_size(t);
  const uint64_t bb = block_bytes(t);
  float tmp[256];
  float s = 0;
  for (int64_t k = 0; k < n / bs; ++k) {
    fn(b + k * bb, tmp);
    s += dot_f32(tmp, x + k * bs, bs);
  }
  return s;
}

}  // namespace cascade::gguf
