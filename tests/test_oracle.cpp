// cascade's logits against llama.cpp's (the oracle) on tiny random models of every architecture the runtime runs,
// in several weight types (tests/data/oracle: the models, the prompts in cases.txt, llama.cpp's logits; made by
// scripts/oracle.sh, VERSION names the llama.cpp). Every logit of every position is compared, on both linear paths
// and under every instruction tier the CPU has. Measured here (AMD EPYC, avx512): the worst error is a quarter of
// the tolerance, about 5 sqrt(sum e_p^2) sd, so G is about 1; breaking any feature of an architecture (a RoPE
// factor, the window layers' base, a norm, a bias, the soft-cap) fails the case that carries it.
//
// Tolerance. Both sides compute in f32 from the same weights; they differ in how activations are rounded before a
// matrix product. llama.cpp rounds them to the type the weight's dot product takes: f16 for F16 weights, bf16 for
// BF16, int8 blocks of 32 (Q8_0) for Q8_0, Q4_0, Q4_1, Q5_0, and int8 blocks of 256 (Q8_K) for the K-quants;
// cascade's quantized path rounds them to int8 blocks of 32 for every quantized type and to bf16 for BF16 (where
// the CPU multiplies bf16), its f32 path not at all. A rounding of relative rms error e moves a product's output
// by about e of its size. With e_p for product p (both sides' errors, independent, added in quadrature), the
// logits move by about G sqrt(sum over p of e_p^2) of their spread (standard deviation), where G, the network's
// gain on such errors, is about 1 for these models; the largest of some thousand logits is within 5 of that. The
// tolerance is 4x that, K = 20:
//   |cascade - llama.cpp| <= 20 sqrt(sum e_p^2) sd + 1e-4 sd + 1e-4 |ref|
// (1e-4: f32 arithmetic in another order, and llama.cpp's angles and GELU in f32/f16 steps). e per rounding:
//   f16  2^-11 / sqrt(3) (half an ulp of 11 bits, uniform)   bf16  2^-8 / sqrt(3)
//   int8 blocks of 32: max|x| / 127 / sqrt(12) of rms|x|, max/rms ~ 2.5 for 32 Gaussian values: 0.0057
//   int8 blocks of 256 (Q8_K): max/rms ~ 3.1: 0.0070
// and gemma3's GELU, which llama.cpp reads from a table of f16 inputs and outputs: 2 f16 roundings per FFN.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "cascade/simd.hpp"
#include "model/gguf.hpp"
#include "model/kv_cache.hpp"
#include "model/linear.hpp"
#include "model/llama.hpp"

namespace test_oracle {

using namespace cascade;
using gguf::TensorType;

namespace {

const std::string kDir = std::string(CASCADE_TESTDATA_DIR) + "/oracle/";
constexpr int64_t kOracleContext = 256;  // oracle-logits' context: which RoPE factors a longrope model takes

struct Case {
  std::string name, file, mode;
  std::vector<int32_t> tokens;
};

std::vector<Case> read_cases() {
  std::ifstream in(kDir + "cases.txt");
  REQUIRE_MESSAGE(bool(in), "no " << kDir << "cases.txt (scripts/oracle.sh makes it)");
  std::vector<Case> cases;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ss(line);
    Case c;
    ss >> c.name >> c.file >> c.mode;
    for (int32_t t; ss >> t;) c.tokens.push_back(t);
    cases.push_back(std::move(c));
  }
  return cases;
}

std::vector<float> read_logits(const std::string& name, size_t n) {
  std::ifstream in(kDir + name + ".logits", std::ios::binary);
  REQUIRE_MESSAGE(bool(in), "no " << kDir << name << ".logits");
  std::vector<float> v(n);
  in.read(reinterpret_cast<char*>(v.data()), std::streamsize(n * sizeof(float)));
  REQUIRE_MESSAGE(in.gcount() == std::streamsize(n * sizeof(float)), name << ".logits is too short");
  CHECK(in.peek() == std::char_traits<char>::eof());
  return v;
}

// Every position's logits of the prompt in one pass: (n, n_vocab).
std::vector<float> cascade_logits(const llama::Model& m, const std::vector<int32_t>& tokens) {
  const llama::Hparams& hp = m.hparams();
  TreeCache cache(int(hp.n_layer), hp.head_shape(), DType::f32);
  const int seg = cache.add_segment(-1, 0);
  std::vector<int32_t> pos(tokens.size());
  std::vector<int64_t> rows(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) pos[i] = int32_t(i), rows[i] = int64_t(i);
  cache.begin_step({{seg, int64_t(tokens.size()), 0}});
  std::vector<float> logits;
  m.forward(tokens, pos, cache, rows, logits);
  return logits;
}

// Relative rms error of rounding a matrix product's activations, on llama.cpp's side and on cascade's.
double e_llama(TensorType t) {
  switch (t) {
    case TensorType::F32: return 0;
    case TensorType::F16: return std::ldexp(1.0, -11) / std::sqrt(3.0);
    case TensorType::BF16: return std::ldexp(1.0, -8) / std::sqrt(3.0);
    case TensorType::Q4_K: case TensorType::Q5_K: case TensorType::Q6_K: return 3.1 / 127 / std::sqrt(12.0);
    default: return 2.5 / 127 / std::sqrt(12.0);
  }
}
double e_cascade(TensorType t, llama::LinearPath path) {
  if (path == llama::LinearPath::f32 || t == TensorType::F32 || t == TensorType::F16) return 0;
  if (t == TensorType::BF16) return std::ldexp(1.0, -8) / std::sqrt(3.0);  // where the CPU multiplies bf16
  return 2.5 / 127 / std::sqrt(12.0);
}

// sqrt(sum over the model's products of e_p^2).
double rounding_error(const llama::Model& m, llama::LinearPath path) {
  double sum = 0;
  const auto add = [&](const llama::Linear& w) {
    const double a = e_llama(w.type), b = e_cascade(w.type, path);
    sum += a * a + b * b;
  };
  const llama::Weights& w = m.weights();
  for (const llama::Layer& l : w.layers) {
    for (const llama::Linear* p : {&l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_gate, &l.ffn_up, &l.ffn_down}) add(*p);
    if (m.hparams().act == llama::Activation::gelu) sum += 2 * std::pow(std::ldexp(1.0, -11) / std::sqrt(3.0), 2);
  }
  add(w.lm_head());
  return std::sqrt(sum);
}

// Compares got with the reference: CHECKs every logit within the tolerance (the header); returns the worst
// |got - ref| in standard deviations of ref.
double compare(const std::vector<float>& got, const std::vector<float>& ref, double e, const std::string& what) {
  REQUIRE(got.size() == ref.size());
  double mean = 0, var = 0;
  for (float v : ref) mean += v;
  mean /= double(ref.size());
  for (float v : ref) var += (v - mean) * (v - mean);
  const double sd = std::sqrt(var / double(ref.size()));
  double worst = 0, worst_abs = 0;
  int bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(double(got[i]) - ref[i]);
    const double tol = 20 * e * sd + 1e-4 * sd + 1e-4 * std::fabs(ref[i]);
    worst = std::max(worst, err / tol);
    worst_abs = std::max(worst_abs, err);
    bad += !(err <= tol);
  }
  INFO(what << ": logits' sd " << sd << ", sqrt(sum e^2) " << e << ", worst |cascade - llama.cpp| " << worst_abs
            << " = " << worst_abs / sd << " sd, worst / tolerance " << worst);
  CHECK(bad == 0);
  CHECK(sd > 0.5);  // logits that say something
  return worst_abs / sd;
}

}  // namespace

// Every case on both linear paths, under every instruction tier the CPU has (the linear layers' kernels and the
// attention's are chosen per tier). The worst error per case is printed (-s).
TEST_CASE("oracle: every architecture's logits within tolerance of llama.cpp's, every weight type, every path") {
  std::vector<Isa> tiers = {Isa::portable};
  if (active_isa() >= Isa::avx2) tiers.push_back(Isa::avx2);
  if (active_isa() >= Isa::avx512) tiers.push_back(Isa::avx512);
  for (const Case& c : read_cases()) {
    CAPTURE(c.name);
    const gguf::File file = gguf::File::open(kDir + c.file);
    double worst[2] = {0, 0};
    for (llama::LinearPath path : {llama::LinearPath::quantized, llama::LinearPath::f32}) {
      llama::Model m = llama::Model::load(file, path);
      m.set_context_length(kOracleContext);
      const std::vector<float> ref = read_logits(c.name, c.tokens.size() * size_t(m.hparams().n_vocab));
      for (Isa isa : tiers) {
        const IsaLimit cap(isa);
        const std::string what = c.name + (path == llama::LinearPath::f32 ? ", f32 path, " : ", quantized path, ") +
                                 isa_name(isa);
        const std::vector<float> got = cascade_logits(m, c.tokens);
        double& w = worst[path == llama::LinearPath::f32];
        w = std::max(w, compare(got, ref, rounding_error(m, path), what));
      }
    }
    MESSAGE(c.name << ": worst |cascade - llama.cpp| / sd: quantized path " << worst[0] << ", f32 path " << worst[1]);
  }
}

}  // namespace test_oracle
