// Every CPU kernel path this machine can run, for the tests that compare each against the reference: each
// instruction-set tier up to the CPU's widest (forced with IsaLimit), and on CPUs with AVX512_BF16 the
// AVX-512 tier with bf16 products, whose error bound differs (cpu/kernel_avx512.hpp), on vdpbf16ps and, where
// the process may run AMX tiles, on those (cpu/kernel_amx.hpp); on CPUs with AVX512_VNNI the AVX-512 tier with
// q8_0 K/V on int8 products (cpu/kernel_q8.hpp), which round q to int8. The other paths keep q8_0 on f32 products.
// Plans are made under the path too: the kernel a pass takes is picked then.
#pragma once

#include <string>
#include <vector>

#include "cascade/cascade.hpp"

namespace test {

struct KernelPath {
  cascade::Isa isa = cascade::Isa::portable;
  bool bf16_products = false;
  bool amx = false;  // bf16 products on AMX tiles
  bool int8_products = false;  // q8_0 K/V on int8 dot products
  std::string name() const {
    return std::string(cascade::isa_name(isa)) + (bf16_products ? (amx ? "+amx" : "+bf16") : "") +
           (int8_products ? "+int8" : "");
  }
  // Whether bf16 K/V take the bf16-product kernel on this path.
  bool rounds_bf16() const {
    return bf16_products && isa == cascade::Isa::avx512 && cascade::cpu_features().avx512_bf16;
  }
  // Whether q8_0 K/V of head dim d take the int8-product kernel on this path (its per-sequence passes).
  bool rounds_int8(int d) const {
    return int8_products && isa == cascade::Isa::avx512 && cascade::cpu_features().avx512_vnni && d % 64 == 0;
  }
};

// Runs the kernels of `path` for one scope.
struct UsePath {
  explicit UsePath(const KernelPath& path)
      : isa(path.isa), products(path.bf16_products), tiles(path.amx), int8(path.int8_products) {}
  cascade::IsaLimit isa;
  cascade::cpu::Bf16Products products;
  cascade::cpu::AmxTiles tiles;
  cascade::cpu::Int8Products int8;
};

inline std::vector<KernelPath> kernel_paths() {
  using cascade::Isa;
  std::vector<KernelPath> paths;
  for (Isa isa : {Isa::portable, Isa::avx2, Isa::avx512})
    if (isa <= cascade::detected_isa()) paths.push_back({isa, false, false});
  if (cascade::detected_isa() == Isa::avx512 && cascade::cpu_features().avx512_bf16)
    paths.push_back({Isa::avx512, true, false});
  if (cascade::detected_isa() == Isa::avx512 && cascade::amx_usable()) paths.push_back({Isa::avx512, true, true});
  if (cascade::detected_isa() == Isa::avx512 && cascade::cpu_features().avx512_vnni)
    paths.push_back({Isa::avx512, false, false, true});
  return paths;
}

// The bf16-product kernel rounds q to bf16 before S = Q K^T: tests give it bf16 queries (as a bf16 model
// does), so that the remaining error is the rounding of the softmax weights, |o - o_exact| <= 2^-8 max |v|.
inline void round_to_bf16(std::vector<float>& q) {
  for (float& x : q) x = float(cascade::bf16(x));
}
inline constexpr double kBf16WeightError = 0x1p-8;
inline constexpr double kInt8WeightError = 64.0 / 65534.0;

// The int8-product kernel quantizes q per block of 32 head dims (cpu/kernel_q8.hpp): tests give it q on the q8_0
// grid (codes times f16 scales), which it quantizes exactly, so that what remains is its rounding of the weights of
// P V to 16 bits per tile of 64 keys, |o - o_exact| <= 64 / 65534 max |v|.
inline void round_to_q8_0(std::vector<float>& q) {
  std::vector<int8_t> codes(q.size());
  std::vector<cascade::f16> scales(q.size() / cascade::kQ8Block);
  cascade::quantize_q8_0(q.data(), int64_t(q.size()), codes.data(), scales.data());
  cascade::dequantize_q8_0(codes.data(), scales.data(), int64_t(q.size()), q.data());
}

}  // namespace test
