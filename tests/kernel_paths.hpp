// Every CPU kernel path this machine can run, for the tests that compare each against the reference: each
// instruction-set tier up to the CPU's widest (forced with IsaLimit), and on CPUs with AVX512_BF16 the
// AVX-512 tier with bf16 products, whose error bound differs (cpu/kernel_avx512.hpp), on vdpbf16ps and, where
// the process may run AMX tiles, on those (cpu/kernel_amx.hpp). Plans are made under the path too: the kernel a
// pass takes is picked then.
#pragma once

#include <string>
#include <vector>

#include "cascade/cascade.hpp"

namespace test {

struct KernelPath {
  cascade::Isa isa = cascade::Isa::portable;
  bool bf16_products = false;
  bool amx = false;  // bf16 products on AMX tiles
  std::string name() const {
    return std::string(cascade::isa_name(isa)) + (bf16_products ? (amx ? "+amx" : "+bf16") : "");
  }
  // Whether bf16 K/V take the bf16-product kernel on this path.
  bool rounds_bf16() const {
    return bf16_products && isa == cascade::Isa::avx512 && cascade::cpu_features().avx512_bf16;
  }
};

// Runs the kernels of `path` for one scope.
struct UsePath {
  explicit UsePath(const KernelPath& path) : isa(path.isa), products(path.bf16_products), tiles(path.amx) {}
  cascade::IsaLimit isa;
  cascade::cpu::Bf16Products products;
  cascade::cpu::AmxTiles tiles;
};

inline std::vector<KernelPath> kernel_paths() {
  using cascade::Isa;
  std::vector<KernelPath> paths;
  for (Isa isa : {Isa::portable, Isa::avx2, Isa::avx512})
    if (isa <= cascade::detected_isa()) paths.push_back({isa, false, false});
  if (cascade::detected_isa() == Isa::avx512 && cascade::cpu_features().avx512_bf16)
    paths.push_back({Isa::avx512, true, false});
  if (cascade::detected_isa() == Isa::avx512 && cascade::amx_usable()) paths.push_back({Isa::avx512, true, true});
  return paths;
}

// The bf16-product kernel rounds q to bf16 before S = Q K^T: tests give it bf16 queries (as a bf16 model
// does), so that the remaining error is the rounding of the softmax weights, |o - o_exact| <= 2^-8 max |v|.
inline void round_to_bf16(std::vector<float>& q) {
  for (float& x : q) x = float(cascade::bf16(x));
}
inline constexpr double kBf16WeightError = 0x1p-8;

}  // namespace test
