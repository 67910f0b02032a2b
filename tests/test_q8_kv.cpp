// q8_0 K/V: the quantizer against its own round trip and against GGUF's Q8_0 block decoder (model/quant.hpp, an
// independent reading of the same numbers), the reference's reading of q8_0 views, and the views' checks.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cascade/cascade.hpp"
#include "model/quant.hpp"

namespace test_q8_kv {

using namespace cascade;

namespace {

uint64_t fresh_seed() {
  if (const char* s = std::getenv("CASCADE_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
}

// n values in blocks of 32, each block at its own magnitude (1e-3 to 1e3, some all zero, some with one large
// outlier), so that scales of many sizes are drawn.
std::vector<float> random_blocks(std::mt19937_64& rng, int64_t n) {
  std::vector<float> x(static_cast<size_t>(n));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), e(-3.0f, 3.0f);
  for (int64_t b = 0; b < n; b += 32) {
    const float amp = std::pow(10.0f, e(rng));
    const int kind = int(rng() % 8);
    for (int64_t i = b; i < b + 32; ++i) x[size_t(i)] = kind == 0 ? 0.0f : amp * u(rng);
    if (kind == 1) x[size_t(b + int64_t(rng() % 32))] = 50 * amp;
  }
  return x;
}

}  // namespace

TEST_CASE("quantize_q8_0: within half a step of every value, the scale max|x| / 127 in f16, a fixed point") {
  const uint64_t seed = fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  const int64_t n = 32 * 4096;
  const std::vector<float> x = random_blocks(rng, n);
  std::vector<int8_t> codes(static_cast<size_t>(n));
  std::vector<f16> scales(static_cast<size_t>(n / 32));
  quantize_q8_0(x.data(), n, codes.data(), scales.data());
  std::vector<float> y(static_cast<size_t>(n));
  dequantize_q8_0(codes.data(), scales.data(), n, y.data());
  int64_t bad = 0;
  for (int64_t b = 0; b < n; b += 32) {
    float amax = 0;
    for (int64_t i = b; i < b + 32; ++i) amax = std::max(amax, std::abs(x[size_t(i)]));
    const float d = float(scales[size_t(b / 32)]);
    bad += float(f16(amax / 127.0f)) != d;
    for (int64_t i = b; i < b + 32; ++i) {
      bad += codes[size_t(i)] < -127;
      // half a step, and what the f16 scale's rounding can add at the clamp (127 d within 2^-11 of max|x|)
      bad += !(std::abs(y[size_t(i)] - x[size_t(i)]) <= 0.5f * d * (1 + 1e-6f) + amax * 0x1p-10f);
    }
  }
  CHECK(bad == 0);
  // Quantizing the dequantized values again gives the same codes and scale, for every block whose scale is a normal
  // f16 (q8_0.hpp: a subnormal scale, max |x| below about 7.8e-3, rounds coarser and need not come back).
  std::vector<int8_t> codes2(codes.size());
  std::vector<f16> scales2(scales.size());
  quantize_q8_0(y.data(), n, codes2.data(), scales2.data());
  int64_t n_normal = 0, moved = 0;
  for (int64_t b = 0; b < n / 32; ++b) {
    if (!(float(scales[size_t(b)]) >= 0x1p-14f)) continue;  // f16's smallest normal is 2^-14
    ++n_normal;
    moved += std::memcmp(codes2.data() + b * 32, codes.data() + b * 32, 32) != 0 ||
             std::memcmp(&scales2[size_t(b)], &scales[size_t(b)], sizeof(f16)) != 0;
  }
  CHECK(n_normal > n / 32 / 2);
  CHECK(moved == 0);
}

TEST_CASE("quantize_q8_0: a block as GGUF's Q8_0 decoder reads it (f16 scale first, then 32 codes)") {
  const uint64_t seed = fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  const int64_t n = 32 * 256;
  const std::vector<float> x = random_blocks(rng, n);
  std::vector<int8_t> codes(static_cast<size_t>(n));
  std::vector<f16> scales(static_cast<size_t>(n / 32));
  quantize_q8_0(x.data(), n, codes.data(), scales.data());
  std::vector<uint8_t> blocks(static_cast<size_t>(n / 32 * 34));
  for (int64_t b = 0; b < n / 32; ++b) {
    std::memcpy(blocks.data() + b * 34, &scales[size_t(b)], 2);
    std::memcpy(blocks.data() + b * 34 + 2, codes.data() + b * 32, 32);
  }
  std::vector<float> gguf(static_cast<size_t>(n)), ours(static_cast<size_t>(n));
  gguf::dequantize_row(gguf::TensorType::Q8_0, blocks.data(), gguf.data(), n);
  dequantize_q8_0(codes.data(), scales.data(), n, ours.data());
  CHECK(std::memcmp(gguf.data(), ours.data(), size_t(n) * 4) == 0);
}

TEST_CASE("quantize_q8_0: zero blocks, NaN and infinity, huge values, and counts that are not whole blocks") {
  std::vector<float> x(96, 0.0f);
  x[40] = std::numeric_limits<float>::quiet_NaN();
  x[70] = std::numeric_limits<float>::infinity();
  for (int i = 64; i < 70; ++i) x[size_t(i)] = 1e9f;
  std::vector<int8_t> codes(96, 5);
  std::vector<f16> scales(3);
  quantize_q8_0(x.data(), 96, codes.data(), scales.data());
  CHECK(float(scales[0]) == 0.0f);
  for (int i = 0; i < 32; ++i) CHECK(codes[size_t(i)] == 0);
  CHECK(std::isnan(float(scales[1])));
  CHECK(std::isnan(float(scales[2])));  // an infinity reads as NaN, as 0 * inf would
  x[70] = 1e9f;
  quantize_q8_0(x.data(), 96, codes.data(), scales.data());
  CHECK(float(scales[2]) == 65504.0f);  // saturated at f16's largest scale, codes clamped
  CHECK(codes[64] == 127);
  CHECK_THROWS_WITH_AS(quantize_q8_0(x.data(), 40, codes.data(), scales.data()),
                       doctest::Contains("not whole blocks"), Error);
}

TEST_CASE("q8_0 views: the reference reads code x scale, contiguous and paged, bad views are refused") {
  const uint64_t seed = fresh_seed();
  INFO("CASCADE_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  const int n_heads = 2, d = 64;
  const int64_t n_tokens = 10, page = 4, n_pages = 3;
  // Paged: pages in reverse order, heads padded by a block.
  const int64_t stride_head = d + 32, stride_token = n_heads * stride_head, stride_page = page * stride_token;
  const int64_t n = n_pages * stride_page;
  const std::vector<float> xk = random_blocks(rng, n), xv = random_blocks(rng, n);
  std::vector<int8_t> k(static_cast<size_t>(n)), v(static_cast<size_t>(n));
  std::vector<f16> ks(static_cast<size_t>(n / 32)), vs(static_cast<size_t>(n / 32));
  quantize_q8_0(xk.data(), n, k.data(), ks.data());
  quantize_q8_0(xv.data(), n, v.data(), vs.data());
  const std::vector<int32_t> table = {2, 1, 0};
  const KvView kv = KvView::paged_q8_0(k.data(), ks.data(), v.data(), vs.data(), table.data(), n_tokens, page, n_heads,
                                       d, stride_page, stride_token, stride_head);
  kv.validate();
  for (int64_t t = 0; t < n_tokens; ++t)
    for (int h = 0; h < n_heads; ++h)
      for (int64_t i = 0; i < d; ++i) {
        const int64_t at = table[size_t(t / page)] * stride_page + (t % page) * stride_token + h * stride_head + i;
        CHECK(kv_element(kv, kv.k, t, h, i) == double(k[size_t(at)]) * double(float(ks[size_t(at / 32)])));
        CHECK(kv_element(kv, kv.v, t, h, i) == double(v[size_t(at)]) * double(float(vs[size_t(at / 32)])));
      }
  const auto refused = [](KvView bad, const char* what) {
    CHECK_THROWS_WITH_AS(bad.validate(), doctest::Contains(what), Error);
  };
  KvView bad = kv;
  bad.head_dim = 48;
  refused(bad, "multiple of 32");
  bad = kv;
  bad.stride_head = 80;
  refused(bad, "strides must be multiples of 32");
  bad = kv;
  bad.stride_page = stride_page + 8;
  refused(bad, "strides must be multiples of 32");
  bad = kv;
  bad.v_scales = nullptr;
  refused(bad, "null q8_0 scales");
  CHECK_THROWS_WITH_AS(parse_dtype("q8"), doctest::Contains("q8_0"), Error);
  CHECK(parse_dtype("q8_0") == DType::q8_0);
  CHECK(kv_element_bytes(DType::q8_0) == 1.0625);
}

}  // namespace test_q8_kv
