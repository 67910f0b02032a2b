// make-random-llama: writes a Llama-architecture GGUF with random weights in the dimensions of a real model,
// so the study can time decode steps at a larger shape than the small model it downloads. The tokenizer
// (every tokenizer.* key) is copied from an existing GGUF, so prompts tokenize as they do for that model;
// the vocabulary size is that tokenizer's.
//
//   make-random-llama --vocab-from models/SmolLM2-135M-Instruct.Q4_1.gguf --out llama-1b-random.gguf
//                     [--shape llama3.2-1b] [--layers N] [--type q8_0|f16|q4_K_M] [--seed N]
//
// Weights: every matrix entry has standard deviation about 0.5/sqrt(n_in) (uniform for q8_0 and f16; random codes
// under random 6-bit or 8-bit group scales for the K-quants), so activations neither vanish nor blow up over the
// layers; norms are ones. The text it generates is noise; the timing is real.
//
// q4_K_M mixes types as llama.cpp's llama-quantize does for that name on a Llama file: q4_K, with attn_v and
// ffn_down in q6_K in the layers it gives more bits (the first and last eighth, and every third one between) and
// the output matrix (here the tied embeddings) in q6_K. Every key is written with the type llama.cpp reads it as
// (the tokenizer's as the source file has them), so llama.cpp loads the files.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "cascade/dtype.hpp"
#include "model/gguf.hpp"

namespace {

namespace gguf = cascade::gguf;

struct Dims {
  int64_t n_embd, n_layer, n_head, n_head_kv, n_ff, n_ctx;
  float rope_base;
};

const std::map<std::string, Dims>& shapes() {
  static const std::map<std::string, Dims> s = {
      {"llama3.2-1b", {2048, 16, 32, 8, 8192, 8192, 500000.0f}},
      {"llama3.2-3b", {3072, 28, 24, 8, 8192, 8192, 500000.0f}},
      {"smollm2-360m", {960, 32, 15, 5, 2560, 8192, 100000.0f}},
  };
  return s;
}

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "make-random-llama: error: %s\n", msg.c_str());
  std::exit(1);
}

struct Rng {
  uint64_t s;
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
};

uint16_t half_bits(double v) {
  const cascade::f16 h(static_cast<float>(v));
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

// One q4_K block of random codes: eight groups of 32 with 6-bit scales in [32, 63] and mins that centre them
// (value = d sc q - dmin m, q uniform in 0..15: sd 4.6 d sc); sd: the values' standard deviation.
void random_q4_k(uint8_t* b, double sd, Rng& rng) {
  const double d = sd / (4.61 * 47.5), dmin = 8 * d;
  const uint16_t dh = half_bits(d), mh = half_bits(dmin);
  std::memcpy(b, &dh, 2);
  std::memcpy(b + 2, &mh, 2);
  int sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = 32 + int(rng.next() % 32);
    mn[j] = int(std::lround(7.5 * sc[j] / 8));
  }
  // the 12 scale bytes as quant.cpp's scale_min_k4 reads them
  uint8_t* s = b + 4;
  for (int j = 0; j < 4; ++j) {
    s[j] = uint8_t(sc[j] | (sc[j + 4] >> 4) << 6);
    s[j + 4] = uint8_t(mn[j] | (mn[j + 4] >> 4) << 6);
    s[j + 8] = uint8_t((sc[j + 4] & 15) | (mn[j + 4] & 15) << 4);
  }
  for (int i = 0; i < 128; i += 8) {
    const uint64_t r = rng.next();
    std::memcpy(b + 16 + i, &r, 8);
  }
}

// One q6_K block of random codes: sixteen groups of 16 with i8 scales in [64, 127] (value = d scale (q - 32), q
// uniform in 0..63: sd 18.5 d scale).
void random_q6_k(uint8_t* b, double sd, Rng& rng) {
  for (int i = 0; i < 192; i += 8) {
    const uint64_t r = rng.next();
    std::memcpy(b + i, &r, 8);
  }
  for (int g = 0; g < 16; ++g) b[192 + g] = uint8_t(64 + rng.next() % 64);
  const uint16_t dh = half_bits(sd / (18.5 * 95.5));
  std::memcpy(b + 208, &dh, 2);
}

// A random (n_out, n_in) matrix, ne = {n_in, n_out}, in Q8_0 (34-byte blocks of 32), F16, Q4_K or Q6_K.
std::vector<uint8_t> random_matrix(gguf::TensorType type, int64_t n_in, int64_t n_out, Rng& rng) {
  const double sd = 0.5 / std::sqrt(double(n_in));
  std::vector<uint8_t> out(size_t(gguf::row_bytes(type, n_in) * uint64_t(n_out)));
  if (type == gguf::TensorType::Q4_K || type == gguf::TensorType::Q6_K) {
    const size_t bb = gguf::block_bytes(type);
    for (size_t b = 0; b < out.size(); b += bb) {
      if (type == gguf::TensorType::Q4_K) random_q4_k(out.data() + b, sd, rng);
      else random_q6_k(out.data() + b, sd, rng);
    }
  } else if (type == gguf::TensorType::Q8_0) {
    // int8 uniform in [-127, 127] has sd ~73.6: scale d = sd / 73.6.
    const cascade::f16 d(float(sd / 73.6));
    uint16_t d_bits;
    std::memcpy(&d_bits, &d, 2);
    for (size_t b = 0; b < out.size(); b += 34) {
      std::memcpy(out.data() + b, &d_bits, 2);
      for (int i = 0; i < 32; i += 8) {
        uint64_t r = rng.next();
        for (int k = 0; k < 8; ++k, r >>= 8) out[b + 2 + i + k] = uint8_t(int8_t(int(r & 0xff) % 255 - 127));
      }
    }
  } else {
    auto* p = reinterpret_cast<cascade::f16*>(out.data());
    const double amp = sd * std::sqrt(3.0);
    for (int64_t i = 0; i < n_in * n_out; ++i)
      p[i] = cascade::f16(float(amp * (2.0 * double(rng.next() >> 11) / double(uint64_t(1) << 53) - 1.0)));
  }
  return out;
}

void copy_tokenizer(const gguf::File& src, gguf::Writer& w) {
  for (const gguf::KeyValue& kv : src.kvs()) {
    if (kv.key.substr(0, 10) != "tokenizer.") continue;
    const gguf::Value& v = kv.value;
    switch (v.type) {
      case gguf::ValueType::STRING: w.set_string(kv.key, v.str); break;
      case gguf::ValueType::BOOL: w.set_bool(kv.key, v.u != 0); break;
      // each with its own type: llama.cpp refuses a token id of another width ("wrong type u64 but expected u32")
      case gguf::ValueType::U8: w.set_u8(kv.key, uint8_t(v.u)); break;
      case gguf::ValueType::U16: w.set_u16(kv.key, uint16_t(v.u)); break;
      case gguf::ValueType::U32: w.set_u32(kv.key, uint32_t(v.u)); break;
      case gguf::ValueType::U64: w.set_u64(kv.key, v.u); break;
      case gguf::ValueType::I8: w.set_i8(kv.key, int8_t(v.i)); break;
      case gguf::ValueType::I16: w.set_i16(kv.key, int16_t(v.i)); break;
      case gguf::ValueType::I32: w.set_i32(kv.key, int32_t(v.i)); break;
      case gguf::ValueType::I64: w.set_i64(kv.key, v.i); break;
      case gguf::ValueType::F32: w.set_f32(kv.key, float(v.f)); break;
      case gguf::ValueType::F64: w.set_f64(kv.key, v.f); break;
      case gguf::ValueType::ARRAY:
        if (v.elem_type == gguf::ValueType::STRING) w.set_string_array(kv.key, std::span<const std::string_view>(v.strings));
        else w.set_array(kv.key, v.elem_type, v.elems, v.count);
        break;
      default: die("tokenizer key '" + std::string(kv.key) + "' has a type this tool cannot copy");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string out, vocab_from, shape = "llama3.2-1b", type_name = "q8_0";
  int64_t layers = 0;
  uint64_t seed = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die(a + " needs a value");
      return argv[++i];
    };
    if (a == "--out") out = value();
    else if (a == "--vocab-from") vocab_from = value();
    else if (a == "--shape") shape = value();
    else if (a == "--layers") layers = std::atoll(value().c_str());
    else if (a == "--type") type_name = value();
    else if (a == "--seed") seed = std::strtoull(value().c_str(), nullptr, 10);
    else if (a == "-h" || a == "--help") {
      std::printf("usage: make-random-llama --vocab-from GGUF --out FILE [--shape llama3.2-1b|llama3.2-3b|smollm2-360m]"
                  " [--layers N] [--type q8_0|f16|q4_K_M] [--seed N]\n");
      return 0;
    } else die("unknown flag '" + a + "'");
  }
  if (out.empty() || vocab_from.empty()) die("--out and --vocab-from are required (see --help)");
  auto it = shapes().find(shape);
  if (it == shapes().end()) die("unknown --shape '" + shape + "'");
  Dims dm = it->second;
  if (layers > 0) dm.n_layer = layers;
  // the type of most matrices, and of the ones q4_K_M gives more bits (attn_v, ffn_down in some layers; output)
  gguf::TensorType type, more;
  if (type_name == "q8_0") type = more = gguf::TensorType::Q8_0;
  else if (type_name == "f16") type = more = gguf::TensorType::F16;
  else if (type_name == "q4_K_M") type = gguf::TensorType::Q4_K, more = gguf::TensorType::Q6_K;
  else die("--type must be q8_0, f16 or q4_K_M");
  try {
    const gguf::File src = gguf::File::open(vocab_from);
    const int64_t n_vocab = int64_t(src.get_string_array("tokenizer.ggml.tokens").size());
    const int64_t head_dim = dm.n_embd / dm.n_head, dkv = head_dim * dm.n_head_kv;
    gguf::Writer w;
    w.set_string("general.architecture", "llama");
    w.set_string("general.name", "random " + shape);
    w.set_u32("llama.context_length", uint32_t(dm.n_ctx));
    w.set_u32("llama.embedding_length", uint32_t(dm.n_embd));
    w.set_u32("llama.block_count", uint32_t(dm.n_layer));
    w.set_u32("llama.feed_forward_length", uint32_t(dm.n_ff));
    w.set_u32("llama.attention.head_count", uint32_t(dm.n_head));
    w.set_u32("llama.attention.head_count_kv", uint32_t(dm.n_head_kv));
    w.set_u32("llama.rope.dimension_count", uint32_t(head_dim));
    w.set_f32("llama.rope.freq_base", dm.rope_base);
    w.set_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
    copy_tokenizer(src, w);
    Rng rng{seed * 0x9E3779B97F4A7C15ull | 1};
    const std::vector<float> ones(size_t(std::max(dm.n_embd, dm.n_ff)), 1.0f);
    auto matrix = [&](const std::string& name, int64_t n_in, int64_t n_out, gguf::TensorType t) {
      const std::vector<uint8_t> data = random_matrix(t, n_in, n_out, rng);
      w.add_tensor(name, t, {n_in, n_out}, data.data());
    };
    // llama-quantize's layers with more bits: the first and last eighth, and every third between
    const auto more_bits = [&](int64_t il) {
      const int64_t n = dm.n_layer;
      return il < n / 8 || il >= 7 * n / 8 || (il - n / 8) % 3 == 2;
    };
    matrix("token_embd.weight", dm.n_embd, n_vocab, more);  // tied output
    w.add_tensor("output_norm.weight", gguf::TensorType::F32, {dm.n_embd}, ones.data());
    for (int64_t il = 0; il < dm.n_layer; ++il) {
      const std::string p = "blk." + std::to_string(il) + ".";
      w.add_tensor(p + "attn_norm.weight", gguf::TensorType::F32, {dm.n_embd}, ones.data());
      w.add_tensor(p + "ffn_norm.weight", gguf::TensorType::F32, {dm.n_embd}, ones.data());
      const gguf::TensorType tv = more_bits(il) ? more : type;
      matrix(p + "attn_q.weight", dm.n_embd, dm.n_embd, type);
      matrix(p + "attn_k.weight", dm.n_embd, dkv, type);
      matrix(p + "attn_v.weight", dm.n_embd, dkv, tv);
      matrix(p + "attn_output.weight", dm.n_embd, dm.n_embd, type);
      matrix(p + "ffn_gate.weight", dm.n_embd, dm.n_ff, type);
      matrix(p + "ffn_up.weight", dm.n_embd, dm.n_ff, type);
      matrix(p + "ffn_down.weight", dm.n_ff, dm.n_embd, tv);
    }
    w.write(out);
    std::fprintf(stderr, "make-random-llama: wrote %s (%s, %lld layers, vocab %lld, %s)\n", out.c_str(), shape.c_str(),
                 (long long)dm.n_layer, (long long)n_vocab, type_name.c_str());
  } catch (const std::exception& e) {
    die(e.what());
  }
  return 0;
}
