// Bytes -> gguf::File::from_bytes. When the file validates, every key/value and every tensor is touched (the
// first and last byte of each tensor's data, a few rows of each dequantizable tensor within a budget, through
// both dequantize_row and dot_row), then the file's vocabulary is loaded, a tokenizer built and run, and its chat
// template applied. cascade::Error is a fine answer to a bad file; a crash, UB or another exception is not.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "model/chat.hpp"
#include "model/gguf.hpp"
#include "model/quant.hpp"
#include "model/tokenizer.hpp"

namespace {

using namespace cascade;
using namespace cascade::gguf;

// Budgets per input: values dequantized in all, array elements read per key.
constexpr int64_t kMaxValues = int64_t(1) << 16;
constexpr uint64_t kMaxElems = 1024;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_gguf: %s\n", what);
  std::abort();
}

volatile uint64_t g_sink;  // keeps the reads from being optimized away

void touch_value(const File& f, const KeyValue& kv) {
  const Value& v = kv.value;
  uint64_t h = kv.key.size();
  if (f.find(kv.key) != &v) fail("find(key) does not return the key's own value");
  if (auto u = v.as_uint()) h += *u;
  if (auto i = v.as_int()) h += uint64_t(*i);
  if (auto x = v.as_float()) h += uint64_t(std::isfinite(*x));
  if (v.type == ValueType::STRING && !v.str.empty()) h += uint8_t(v.str.front()) + uint8_t(v.str.back());
  if (v.is_array()) {
    if (v.elem_type == ValueType::STRING) {
      if (v.strings.size() != v.count) fail("string array count differs from its elements");
      for (uint64_t k = 0; k < v.count && k < kMaxElems; ++k)
        if (!v.strings[k].empty()) h += uint8_t(v.strings[k].front()) + uint8_t(v.strings[k].back());
    } else {
      for (uint64_t k = 0; k < v.count && k < kMaxElems; ++k) {
        if (auto i = v.elem_int(k)) h += uint64_t(*i);
        if (auto x = v.elem_float(k)) h += uint64_t(std::isfinite(*x));
      }
      if (v.count > 0) {  // the last element too, wherever it lies
        if (auto i = v.elem_int(v.count - 1)) h += uint64_t(*i);
        if (auto x = v.elem_float(v.count - 1)) h += uint64_t(std::isfinite(*x));
      }
      if (v.elem_int(v.count) || v.elem_float(v.count)) fail("an array element past the end was returned");
    }
  }
  // The typed getters either answer or throw Error, whatever the value's type.
  const auto attempt = [&](auto&& get) {
    try {
      get();
    } catch (const Error&) {
    }
  };
  attempt([&] { h += f.get_uint_opt(kv.key).value_or(0); });
  attempt([&] { h += uint64_t(f.get_int_opt(kv.key).value_or(0)); });
  attempt([&] { h += uint64_t(f.get_float_opt(kv.key).value_or(0) > 0); });
  attempt([&] { h += f.get_string_opt(kv.key).value_or("").size(); });
  attempt([&] { h += f.get_bool_opt(kv.key).value_or(false); });
  if (v.count <= kMaxElems) {
    attempt([&] { h += f.get_string_array(kv.key).size(); });
    attempt([&] { h += f.get_float_array(kv.key).size(); });
    attempt([&] { h += f.get_int_array(kv.key).size(); });
  }
  g_sink = g_sink + h;
}

void touch_tensors(const File& f) {
  int64_t budget = kMaxValues;
  std::vector<float> row, x;
  for (const TensorInfo& t : f.tensors()) {
    if (f.find_tensor(t.name) != &t) fail("find_tensor(name) does not return the tensor");
    if (t.offset + t.n_bytes > f.size() - f.data_offset()) fail("tensor data past the end of the file");
    const uint8_t* p = f.tensor_data(t);
    if (t.n_bytes > 0) g_sink = g_sink + p[0] + p[t.n_bytes - 1];
    if (!can_dequantize(t.type) || budget <= 0) continue;
    const int64_t bs = block_size(t.type);
    // A prefix of whole blocks of each of the first rows, so a huge row cannot exhaust the budget alone.
    const int64_t n = std::min(t.ne[0], std::max<int64_t>(bs, budget / 4 / bs * bs));
    const uint64_t stride = row_bytes(t.type, t.ne[0]);
    const int64_t n_rows = t.n_elements / t.ne[0];
    row.resize(size_t(n));
    x.assign(size_t(n), 0.5f);
    for (int64_t r = 0; r < n_rows && r < 4 && budget > 0; ++r) {
      const int64_t which = r < 3 ? r : n_rows - 1;  // the first rows and the last
      const uint8_t* src = p + uint64_t(which) * stride;
      dequantize_row(t.type, src, row.data(), n);
      const float dot = dot_row(t.type, src, x.data(), n);
      g_sink = g_sink + uint64_t(std::isfinite(dot)) + uint64_t(std::isfinite(row[size_t(n) - 1]));
      budget -= n;
    }
  }
}

void run_tokenizer(const File& f) {
  Vocab vocab;
  try {
    vocab = load_vocab(f);
  } catch (const Error&) {
    return;
  }
  std::string tmpl = vocab.chat_template;
  try {
    const Tokenizer tok(std::move(vocab));
    for (const char* text : {"Hello world, 123!", " <|im_start|>user\n\xff\xfe caf\xc3\xa9  \t\n", ""}) {
      const std::vector<int32_t> ids = tok.encode(text, true, true);
      for (int32_t id : ids)
        if (id < 0 || id >= tok.n_vocab()) fail("encode produced an id outside the vocabulary");
      g_sink = g_sink + tok.decode(ids, true).size() + tok.decode(ids, false).size();
    }
    for (int32_t id = 0; id < tok.n_vocab() && id < 64; ++id) g_sink = g_sink + tok.token_piece(id).size() + tok.is_eog(id);
  } catch (const Error&) {
  }
  if (tmpl.empty()) return;
  try {
    const std::vector<ChatMessage> msgs = {{"user", "Hi"}, {"assistant", "Hello"}, {"user", " x "}};
    g_sink = g_sink + apply_chat_template(tmpl, msgs, true).size() + chatml_default_system(tmpl).size();
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // An exact-size copy, so ASan sees any read past the file's last byte.
  std::vector<uint8_t> bytes(data, data + size);
  try {
    const File f = File::from_bytes(std::move(bytes), "fuzz.gguf");
    for (const KeyValue& kv : f.kvs()) touch_value(f, kv);
    touch_tensors(f);
    run_tokenizer(f);
  } catch (const Error&) {
  }
  return 0;
}
