// Dequantization: one block per type worked out by hand, K-quants against an independent per-element decode
// of random blocks, dot_row against dequantize_row, and Q5_0 widened to Q8_0.
#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "model/quant.hpp"

namespace test_quant {

using namespace cascade::gguf;

namespace {

std::vector<float> decode(TensorType t, const std::vector<uint8_t>& bytes, int64_t n) {
  std::vector<float> y(n, -12345.0f);
  dequantize_row(t, bytes.data(), y.data(), n);
  return y;
}

void put16(std::vector<uint8_t>& b, size_t at, uint16_t v) {
  b[at] = static_cast<uint8_t>(v & 0xff);
  b[at + 1] = static_cast<uint8_t>(v >> 8);
}

// The 12 scale bytes shared by the q4_K and q5_K hand blocks, packed by hand from
//   scale = {1, 2, 3, 4, 33, 40, 63, 17}, min = {0, 1, 2, 3, 48, 5, 6, 63}
// bytes 0-3: scale[0..3] | (scale[4..7] >> 4) << 6    = 1|2<<6, 2|2<<6, 3|3<<6, 4|1<<6
// bytes 4-7: min[0..3]   | (min[4..7] >> 4) << 6      = 0|3<<6, 1|0<<6, 2|0<<6, 3|3<<6
// bytes 8-11: (scale[4..7] & 15) | (min[4..7] & 15) << 4 = 1|0<<4, 8|5<<4, 15|6<<4, 1|15<<4
const uint8_t kScales12[12] = {0x81, 0x82, 0xC3, 0x44, 0xC0, 0x01, 0x02, 0xC3, 0x01, 0x58, 0x6F, 0xF1};
const int kSc[8] = {1, 2, 3, 4, 33, 40, 63, 17};
const int kMn[8] = {0, 1, 2, 3, 48, 5, 6, 63};

}  // namespace

TEST_CASE("quant: fp16 and bf16 conversions") {
  CHECK(fp16_to_fp32(0x3C00) == 1.0f);
  CHECK(fp16_to_fp32(0xC000) == -2.0f);
  CHECK(fp16_to_fp32(0x3800) == 0.5f);
  CHECK(fp16_to_fp32(0x7BFF) == 65504.0f);
  CHECK(fp16_to_fp32(0x0001) == std::ldexp(1.0f, -24));  // smallest subnormal
  CHECK(fp16_to_fp32(0x03FF) == std::ldexp(1023.0f, -24));
  CHECK(fp16_to_fp32(0x0400) == std::ldexp(1.0f, -14));  // smallest normal
  CHECK(std::bit_cast<uint32_t>(fp16_to_fp32(0x8000)) == 0x80000000u);
  CHECK(std::isinf(fp16_to_fp32(0x7C00)));
  CHECK(std::isnan(fp16_to_fp32(0x7E00)));

  // every non-NaN half survives a round trip
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF)) continue;
    REQUIRE(fp32_to_fp16(fp16_to_fp32(static_cast<uint16_t>(h))) == h);
  }
  CHECK(fp32_to_fp16(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);      // tie, rounds to even
  CHECK(fp32_to_fp16(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3C02);  // tie, rounds to even (up)
  CHECK(fp32_to_fp16(65519.0f) == 0x7BFF);
  CHECK(fp32_to_fp16(65520.0f) == 0x7C00);
  CHECK(fp32_to_fp16(std::ldexp(1.0f, -25)) == 0x0000);  // tie between 0 and the smallest subnormal
  CHECK(fp32_to_fp16(std::ldexp(3.0f, -26)) == 0x0001);
  CHECK((fp32_to_fp16(std::nanf("")) & 0x7C00) == 0x7C00);

  CHECK(bf16_to_fp32(0x3F80) == 1.0f);
  CHECK(bf16_to_fp32(0xC0C0) == -6.0f);
  CHECK(fp32_to_bf16(1.0f) == 0x3F80);
  CHECK(fp32_to_bf16(std::bit_cast<float>(0x3F808000u)) == 0x3F80);  // tie, to even
  CHECK(fp32_to_bf16(std::bit_cast<float>(0x3F818000u)) == 0x3F82);  // tie, to even (up)
  CHECK(std::isnan(bf16_to_fp32(fp32_to_bf16(std::nanf("")))));
}

TEST_CASE("quant: f32, f16 and bf16 rows") {
  std::vector<uint8_t> f32(8);
  const float a[2] = {1.5f, -0.25f};
  std::memcpy(f32.data(), a, 8);
  auto y = decode(TensorType::F32, f32, 2);
  CHECK(y == std::vector<float>{1.5f, -0.25f});

  // 0x3C00 = 1, 0xC000 = -2, 0x3800 = 0.5, 0x0001 = 2^-24
  y = decode(TensorType::F16, {0x00, 0x3C, 0x00, 0xC0, 0x00, 0x38, 0x01, 0x00}, 4);
  CHECK(y == std::vector<float>{1.0f, -2.0f, 0.5f, std::ldexp(1.0f, -24)});

  // 0x3F80 = 1, 0xC0C0 = -1.5 * 2^2 = -6, 0x4049 = 3.140625
  y = decode(TensorType::BF16, {0x80, 0x3F, 0xC0, 0xC0, 0x49, 0x40}, 3);
  CHECK(y == std::vector<float>{1.0f, -6.0f, 3.140625f});
}

TEST_CASE("quant: q8_0 block by hand") {
  // d = 0.5 (0x3800), qs = -16..15: y[j] = (j - 16) * 0.5
  std::vector<uint8_t> b = {0x00, 0x38};
  for (int j = 0; j < 32; ++j) b.push_back(static_cast<uint8_t>(static_cast<int8_t>(j - 16)));
  auto y = decode(TensorType::Q8_0, b, 32);
  CHECK(y[0] == -8.0f);
  CHECK(y[16] == 0.0f);
  CHECK(y[31] == 7.5f);
  for (int j = 0; j < 32; ++j) CHECK(y[j] == (j - 16) * 0.5f);
}

TEST_CASE("quant: q4_0 block by hand") {
  // d = 2 (0x4000); qs[j] = j | (15 - j) << 4: y[j] = (j - 8) * 2, y[j + 16] = (7 - j) * 2
  std::vector<uint8_t> b = {0x00, 0x40};
  for (int j = 0; j < 16; ++j) b.push_back(static_cast<uint8_t>(j | (15 - j) << 4));
  auto y = decode(TensorType::Q4_0, b, 32);
  CHECK(y[0] == -16.0f);
  CHECK(y[15] == 14.0f);
  CHECK(y[16] == 14.0f);
  CHECK(y[31] == -16.0f);
  for (int j = 0; j < 16; ++j) {
    CHECK(y[j] == (j - 8) * 2.0f);
    CHECK(y[j + 16] == (7 - j) * 2.0f);
  }
}

TEST_CASE("quant: q4_1 block by hand") {
  // d = 0.5 (0x3800), m = -1 (0xBC00); qs[j] = j | (15 - j) << 4: y[j] = 0.5 j - 1, y[j + 16] = 0.5 (15 - j) - 1
  std::vector<uint8_t> b = {0x00, 0x38, 0x00, 0xBC};
  for (int j = 0; j < 16; ++j) b.push_back(static_cast<uint8_t>(j | (15 - j) << 4));
  auto y = decode(TensorType::Q4_1, b, 32);
  CHECK(y[0] == -1.0f);
  CHECK(y[15] == 6.5f);
  CHECK(y[16] == 6.5f);
  CHECK(y[31] == -1.0f);
  for (int j = 0; j < 16; ++j) {
    CHECK(y[j] == 0.5f * j - 1.0f);
    CHECK(y[j + 16] == 0.5f * (15 - j) - 1.0f);
  }
}

// Q5_0 (ggml's layout: f16 d, u32 qh, u8 qs[16]; value j is ((nibble j) + 16 (bit j of qh) - 16) d, nibble j the
// low nibble of qs[j] for j < 16 and the high nibble of qs[j - 16] after) is widened to Q8_0 at load: the Q8_0
// blocks must hold the same values, here decoded bit by bit from the Q5_0 bytes.
TEST_CASE("quant: q5_0 widened to q8_0 keeps every value") {
  // By hand: d = 0.25 (0x3400), qs[j] = j | (15 - j) << 4, qh = 0xF0F0F0F0 (values 4-7, 12-15, ... have bit 4).
  std::vector<uint8_t> b = {0x00, 0x34, 0xF0, 0xF0, 0xF0, 0xF0};
  for (int j = 0; j < 16; ++j) b.push_back(static_cast<uint8_t>(j | (15 - j) << 4));
  std::vector<uint8_t> q8(34);
  widen_q5_0_to_q8_0(b.data(), q8.data(), 1);
  auto y = decode(TensorType::Q8_0, q8, 32);
  CHECK(y[0] == -4.0f);         // (0 - 16) / 4
  CHECK(y[4] == 1.0f);          // (4 + 16 - 16) / 4
  CHECK(y[16] == (15 - 16) * 0.25f);
  CHECK(y[20] == (11 + 16 - 16) * 0.25f);

  // Random blocks, every code and a spread of scales (subnormal, negative, large).
  std::mt19937 rng(5);
  const int n_blocks = 64;
  std::vector<uint8_t> src(size_t(22 * n_blocks));
  for (auto& x : src) x = static_cast<uint8_t>(rng());
  const uint16_t scales[] = {0x0001, 0x3C00, 0xBC00, 0x7BFF, 0x2E66, 0x8400};
  for (int k = 0; k < n_blocks; ++k) put16(src, size_t(22 * k), scales[k % 6]);
  std::vector<uint8_t> dst(size_t(34 * n_blocks), 0xAA);
  widen_q5_0_to_q8_0(src.data(), dst.data(), n_blocks);
  const std::vector<float> got = decode(TensorType::Q8_0, dst, 32 * n_blocks);
  for (int k = 0; k < n_blocks; ++k) {
    const uint8_t* blk = src.data() + 22 * k;
    const float d = fp16_to_fp32(static_cast<uint16_t>(blk[0] | blk[1] << 8));
    const uint32_t qh = uint32_t(blk[2]) | uint32_t(blk[3]) << 8 | uint32_t(blk[4]) << 16 | uint32_t(blk[5]) << 24;
    for (int j = 0; j < 32; ++j) {
      const int nib = j < 16 ? blk[6 + j] & 15 : blk[6 + j - 16] >> 4;
      const int code = nib + 16 * int((qh >> j) & 1) - 16;
      CAPTURE(k);
      CAPTURE(j);
      REQUIRE(got[size_t(32 * k + j)] == float(code) * d);
    }
  }
}

TEST_CASE("quant: q4_K block by hand") {
  // d = 1 (0x3C00), dmin = 0.5 (0x3800), scales kScales12, qs[i] = (i % 16) | (15 - i % 16) << 4.
  // Group g (64 values) reads qs[32g + l]: y[64g + l] = sc[2g] (l % 16) - 0.5 mn[2g],
  // y[64g + 32 + l] = sc[2g + 1] (15 - l % 16) - 0.5 mn[2g + 1].
  std::vector<uint8_t> b(144, 0);
  put16(b, 0, 0x3C00);
  put16(b, 2, 0x3800);
  std::memcpy(b.data() + 4, kScales12, 12);
  for (int i = 0; i < 128; ++i) b[16 + i] = static_cast<uint8_t>((i % 16) | (15 - i % 16) << 4);
  auto y = decode(TensorType::Q4_K, b, 256);
  CHECK(y[0] == 0.0f);                  // 1 * 0 - 0.5 * 0
  CHECK(y[1] == 1.0f);                  // 1 * 1 - 0
  CHECK(y[32] == 29.5f);                // sub-block 1: 2 * 15 - 0.5 * 1
  CHECK(y[128 + 5] == 141.0f);          // sub-block 4: 33 * 5 - 0.5 * 48
  CHECK(y[192 + 32 + 3] == 172.5f);     // sub-block 7: 17 * 12 - 0.5 * 63
  for (int g = 0; g < 4; ++g)
    for (int l = 0; l < 32; ++l) {
      CHECK(y[64 * g + l] == kSc[2 * g] * (l % 16) - 0.5f * kMn[2 * g]);
      CHECK(y[64 * g + 32 + l] == kSc[2 * g + 1] * (15 - l % 16) - 0.5f * kMn[2 * g + 1]);
    }
}

TEST_CASE("quant: q5_K block by hand") {
  // As the q4_K block, plus qh[l] = 0x55 when l % 4 == 0 (bit 2g set: +16 on the low-nibble values of every
  // group), 0xAA when l % 4 == 1 (bit 2g+1: +16 on the high-nibble values), 0 otherwise.
  std::vector<uint8_t> b(176, 0);
  put16(b, 0, 0x3C00);
  put16(b, 2, 0x3800);
  std::memcpy(b.data() + 4, kScales12, 12);
  for (int l = 0; l < 32; ++l) b[16 + l] = l % 4 == 0 ? 0x55 : l % 4 == 1 ? 0xAA : 0x00;
  for (int i = 0; i < 128; ++i) b[48 + i] = static_cast<uint8_t>((i % 16) | (15 - i % 16) << 4);
  auto y = decode(TensorType::Q5_K, b, 256);
  CHECK(y[0] == 16.0f);                 // q = 0 + 16, sub-block 0: 1 * 16 - 0
  CHECK(y[33] == 59.5f);                // l = 1: q = 14 + 16, sub-block 1: 2 * 30 - 0.5 * 1
  CHECK(y[192 + 32 + 5] == 410.5f);     // l = 5: q = 10 + 16, sub-block 7: 17 * 26 - 0.5 * 63
  CHECK(y[2] == 2.0f);                  // l = 2: no fifth bit
  for (int g = 0; g < 4; ++g)
    for (int l = 0; l < 32; ++l) {
      const int lo = l % 16 + (l % 4 == 0 ? 16 : 0);
      const int hi = 15 - l % 16 + (l % 4 == 1 ? 16 : 0);
      CHECK(y[64 * g + l] == kSc[2 * g] * lo - 0.5f * kMn[2 * g]);
      CHECK(y[64 * g + 32 + l] == kSc[2 * g + 1] * hi - 0.5f * kMn[2 * g + 1]);
    }
}

TEST_CASE("quant: q6_K block by hand") {
  // d = 0.25 (0x3400) at byte 208; scales = {1,-1,2,-2,...,8,-8}; ql[i] = i (low nibble i % 16, high i / 16);
  // qh[i] = 0xE4: bits 0-1 = 0, 2-3 = 1, 4-5 = 2, 6-7 = 3, so the four quarters of each half get high
  // bits 0, 1, 2, 3. Value = 0.25 * scale * (q - 32).
  std::vector<uint8_t> b(210, 0);
  for (int i = 0; i < 128; ++i) b[i] = static_cast<uint8_t>(i);
  for (int i = 0; i < 64; ++i) b[128 + i] = 0xE4;
  const int8_t sc[16] = {1, -1, 2, -2, 3, -3, 4, -4, 5, -5, 6, -6, 7, -7, 8, -8};
  std::memcpy(b.data() + 192, sc, 16);
  put16(b, 208, 0x3400);
  auto y = decode(TensorType::Q6_K, b, 256);
  CHECK(y[0] == -8.0f);           // ql[0] = 0, high 0: q = -32, scale 1: 0.25 * 1 * -32
  CHECK(y[32 + 17] == 7.5f);      // ql[49] & 15 = 1, high 1: q = 17 - 32 = -15, scale sc[3] = -2
  CHECK(y[128 + 96 + 31] == -46.0f);  // ql[127] >> 4 = 7, high 3: q = 55 - 32 = 23, scale sc[15] = -8
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const int q0 = ((64 * h + l) & 15) - 32;
      const int q1 = (((64 * h + l + 32) & 15) | 16) - 32;
      const int q2 = (((64 * h + l) >> 4) | 32) - 32;
      const int q3 = (((64 * h + l + 32) >> 4) | 48) - 32;
      CHECK(y[128 * h + l] == 0.25f * sc[8 * h + l / 16] * q0);
      CHECK(y[128 * h + 32 + l] == 0.25f * sc[8 * h + l / 16 + 2] * q1);
      CHECK(y[128 * h + 64 + l] == 0.25f * sc[8 * h + l / 16 + 4] * q2);
      CHECK(y[128 * h + 96 + l] == 0.25f * sc[8 * h + l / 16 + 6] * q3);
    }
}

namespace {

// Independent per-element decoders: each value is located from its index alone.

float ref_half(const uint8_t* p) { return fp16_to_fp32(static_cast<uint16_t>(p[0] | p[1] << 8)); }

// 6-bit scale (which = 0) or min (which = 1) of sub-block s from the 12 packed bytes.
int ref_k4_field(const uint8_t* sc12, int s, int which) {
  if (s < 4) return sc12[s + 4 * which] & 63;
  const int low = which == 0 ? sc12[s + 4] & 15 : sc12[s + 4] >> 4;
  const int top = sc12[s - 4 + 4 * which] >> 6;
  return low | top << 4;
}

float ref_k(TensorType t, const uint8_t* b, int i) {
  switch (t) {
    case TensorType::Q4_0: {
      const int q = i < 16 ? b[2 + i] & 15 : b[2 + i - 16] >> 4;
      return static_cast<float>(q - 8) * ref_half(b);
    }
    case TensorType::Q4_1: {
      const int q = i < 16 ? b[4 + i] & 15 : b[4 + i - 16] >> 4;
      return static_cast<float>(q) * ref_half(b) + ref_half(b + 2);
    }
    case TensorType::Q8_0:
      return static_cast<float>(static_cast<int8_t>(b[2 + i])) * ref_half(b);
    case TensorType::Q4_K:
    case TensorType::Q5_K: {
      const bool five = t == TensorType::Q5_K;
      const int sub = i / 32, g = i / 64, l = i % 32;
      const uint8_t* qs = b + (five ? 48 : 16);
      int q = (qs[32 * g + l] >> (4 * (sub % 2))) & 15;
      if (five) q += ((b[16 + l] >> sub) & 1) * 16;
      const float d = ref_half(b) * static_cast<float>(ref_k4_field(b + 4, sub, 0));
      const float m = ref_half(b + 2) * static_cast<float>(ref_k4_field(b + 4, sub, 1));
      return d * static_cast<float>(q) - m;
    }
    case TensorType::Q6_K: {
      const int h = i / 128, r = i % 128, quarter = r / 32, l = r % 32;
      const int low = (b[64 * h + l + 32 * (quarter % 2)] >> (4 * (quarter / 2))) & 15;
      const int high = (b[128 + 32 * h + l] >> (2 * quarter)) & 3;
      const auto scale = static_cast<int8_t>(b[192 + 8 * h + 2 * quarter + l / 16]);
      return ref_half(b + 208) * static_cast<float>(scale) * static_cast<float>((low | high << 4) - 32);
    }
    default:
      FAIL((std::string("no reference for ") + type_name(t)));
      return 0;
  }
}

// Random blocks whose f16 fields are finite halves of moderate size.
std::vector<uint8_t> random_blocks(TensorType t, int n_blocks, std::mt19937& rng) {
  const size_t bb = block_bytes(t);
  std::vector<uint8_t> b(bb * n_blocks);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int k = 0; k < n_blocks; ++k) {
    uint8_t* blk = b.data() + k * bb;
    auto set = [&](size_t at) {
      const uint16_t h = fp32_to_fp16(u(rng));
      blk[at] = static_cast<uint8_t>(h);
      blk[at + 1] = static_cast<uint8_t>(h >> 8);
    };
    switch (t) {
      case TensorType::Q4_0: case TensorType::Q8_0: set(0); break;
      case TensorType::Q4_1: case TensorType::Q4_K: case TensorType::Q5_K: set(0); set(2); break;
      case TensorType::Q6_K: set(208); break;
      default: break;
    }
  }
  return b;
}

}  // namespace

TEST_CASE("quant: random blocks against a per-element reference") {
  std::mt19937 rng(1234);
  for (TensorType t : {TensorType::Q4_0, TensorType::Q4_1, TensorType::Q8_0, TensorType::Q4_K, TensorType::Q5_K,
                       TensorType::Q6_K}) {
    CAPTURE(type_name(t));
    const int n_blocks = 7;
    const int64_t bs = block_size(t);
    const auto b = random_blocks(t, n_blocks, rng);
    const auto y = decode(t, b, n_blocks * bs);
    for (int k = 0; k < n_blocks; ++k)
      for (int i = 0; i < bs; ++i) {
        const float ref = ref_k(t, b.data() + k * block_bytes(t), i);
        if (y[k * bs + i] != ref) {
          CAPTURE(k);
          CAPTURE(i);
          REQUIRE(y[k * bs + i] == ref);
        }
      }
  }
}

TEST_CASE("quant: dot_row matches dequantize_row") {
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (TensorType t : {TensorType::F32, TensorType::F16, TensorType::BF16, TensorType::Q4_0, TensorType::Q4_1,
                       TensorType::Q8_0, TensorType::Q4_K, TensorType::Q5_K, TensorType::Q6_K}) {
    CAPTURE(type_name(t));
    const int64_t n = 768;  // three K-quant blocks; 24 q4/q8 blocks; not a multiple of 256 for f32 tails below
    std::vector<uint8_t> row;
    if (t == TensorType::F32 || t == TensorType::F16 || t == TensorType::BF16) {
      for (int64_t k = 0; k < n; ++k) {
        const float v = u(rng);
        if (t == TensorType::F32) {
          const auto x = std::bit_cast<uint32_t>(v);
          for (int s = 0; s < 4; ++s) row.push_back(static_cast<uint8_t>(x >> (8 * s)));
        } else {
          const uint16_t h = t == TensorType::F16 ? fp32_to_fp16(v) : fp32_to_bf16(v);
          row.push_back(static_cast<uint8_t>(h));
          row.push_back(static_cast<uint8_t>(h >> 8));
        }
      }
    } else {
      row = random_blocks(t, static_cast<int>(n / block_size(t)), rng);
    }
    std::vector<float> x(n);
    for (auto& v : x) v = u(rng);
    for (int64_t m : {n, int64_t{256}, t == TensorType::F32 ? int64_t{300} : int64_t{256}}) {
      const auto y = decode(t, row, m);
      double ref = 0, mag = 0;
      for (int64_t k = 0; k < m; ++k) {
        ref += static_cast<double>(y[k]) * x[k];
        mag += std::fabs(static_cast<double>(y[k]) * x[k]);
      }
      const float got = dot_row(t, row.data(), x.data(), m);
      CHECK(std::fabs(got - ref) <= 1e-5 * mag + 1e-6);
    }
  }
}

TEST_CASE("quant: unsupported types and partial blocks are errors") {
  CHECK(can_dequantize(TensorType::Q4_1));
  CHECK(can_dequantize(TensorType::BF16));
  CHECK_FALSE(can_dequantize(TensorType::Q2_K));
  CHECK_FALSE(can_dequantize(TensorType::Q5_0));
  CHECK_FALSE(can_dequantize(static_cast<TensorType>(4)));

  std::vector<uint8_t> buf(1024);
  std::vector<float> y(256);
  try {
    dequantize_row(TensorType::Q2_K, buf.data(), y.data(), 256);
    FAIL("q2_K should not dequantize");
  } catch (const cascade::Error& e) {
    CHECK(std::string(e.what()).find("q2_K") != std::string::npos);
  }
  CHECK_THROWS_AS(dequantize_row(TensorType::Q4_1, buf.data(), y.data(), 48), cascade::Error);
  CHECK_THROWS_AS(dot_row(TensorType::Q6_K, buf.data(), y.data(), 128), cascade::Error);
  CHECK_THROWS_AS(dot_row(static_cast<TensorType>(77), buf.data(), y.data(), 32), cascade::Error);
}

}  // namespace test_quant
