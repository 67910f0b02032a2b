// simd.hpp: the CPU features and name read from CPUID against the kernel's own report (/proc/cpuinfo), and the
// instruction-set tier and its limit.
#include "cascade/simd.hpp"

#include <doctest/doctest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace test_simd {

namespace {

// The flags line of /proc/cpuinfo, or an empty set where there is none.
std::set<std::string> proc_cpu_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> flags;
    for (std::string w; words >> w;) flags.insert(w);
    return flags;
  }
  return {};
}

}  // namespace

TEST_CASE("simd: CPUID features agree with the kernel's /proc/cpuinfo flags") {
  const auto flags = proc_cpu_flags();
  if (flags.empty()) {
    MESSAGE("no /proc/cpuinfo flags here: nothing to compare with");
    return;
  }
  const cascade::CpuFeatures& f = cascade::cpu_features();
  const auto has = [&](const char* name) { return flags.count(name) > 0; };
  CHECK(f.avx2 == has("avx2"));
  CHECK(f.fma == has("fma"));
  CHECK(f.f16c == has("f16c"));
  CHECK(f.avx512f == has("avx512f"));
  CHECK(f.avx512bw == has("avx512bw"));
  CHECK(f.avx512vl == has("avx512vl"));
  CHECK(f.avx512dq == has("avx512dq"));
  CHECK(f.avx512_vnni == has("avx512_vnni"));
  CHECK(f.avx512_bf16 == has("avx512_bf16"));
  CHECK(f.avx_vnni == has("avx_vnni"));
}

TEST_CASE("simd: the active tier is the CPU's widest, capped by the limit in one scope") {
  using cascade::Isa;
  const Isa found = cascade::detected_isa();
  CHECK(cascade::active_isa() == found);
  {
    cascade::IsaLimit cap(Isa::portable);
    CHECK(cascade::active_isa() == Isa::portable);
    {
      cascade::IsaLimit wider(Isa::avx512);  // a cap above the CPU changes nothing
      CHECK(cascade::active_isa() == found);
    }
    CHECK(cascade::active_isa() == Isa::portable);
  }
  CHECK(cascade::active_isa() == found);
  for (Isa isa : {Isa::portable, Isa::avx2, Isa::avx512}) CHECK(cascade::parse_isa(cascade::isa_name(isa)) == isa);
  CHECK_THROWS_WITH_AS(cascade::parse_isa("sse9"),
                       doctest::Contains("unknown instruction set 'sse9' (expected portable, avx2 or avx512)"),
                       cascade::Error);
}

TEST_CASE("simd: the CPU's name and feature names agree with /proc/cpuinfo") {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model;
  while (model.empty() && std::getline(in, line))
    if (line.rfind("model name", 0) == 0) model = line.substr(line.find(':') + 1);
  const auto flags = proc_cpu_flags();
  if (model.empty() || flags.empty()) {
    MESSAGE("no /proc/cpuinfo model name or flags here: nothing to compare with");
    return;
  }
  // The kernel pads and may shorten the brand string; ours is trimmed, so compare word by word.
  std::istringstream a(model), b(cascade::cpu_model_name());
  std::vector<std::string> wa, wb;
  for (std::string w; a >> w;) wa.push_back(w);
  for (std::string w; b >> w;) wb.push_back(w);
  CHECK(wa == wb);
  std::istringstream names(cascade::cpu_feature_names());
  std::set<std::string> ours;
  for (std::string w; names >> w;) ours.insert(w);
  for (const char* f : {"avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                        "avx512_bf16", "amx_tile", "amx_bf16"})
    CHECK_MESSAGE(ours.count(f) == flags.count(f), f);
  CHECK(ours.size() <= 12);
}

TEST_CASE("simd: the vendor and family that CPUID names agree with /proc/cpuinfo and pick where prefetches go") {
  std::ifstream in("/proc/cpuinfo");
  std::string line, vendor;
  int family = -1;
  while ((vendor.empty() || family < 0) && std::getline(in, line)) {
    std::istringstream words(line.substr(line.find(':') + 1));
    if (line.rfind("vendor_id", 0) == 0) words >> vendor;
    else if (line.rfind("cpu family", 0) == 0) words >> family;
  }
  if (vendor.empty() || family < 0) {
    MESSAGE("no /proc/cpuinfo vendor_id or cpu family here: nothing to compare with");
    return;
  }
  CHECK(cascade::cpu_features().amd == (vendor == "AuthenticAMD"));
  CHECK(cascade::cpu_features().family == family);
  // the attention kernels' K/V prefetches: into L1 on Zen 5 and later AMD cores
  CHECK(cascade::prefetch_to_l1() == (vendor == "AuthenticAMD" && family >= 26));
}

}  // namespace test_simd
