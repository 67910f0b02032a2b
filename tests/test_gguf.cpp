// GGUF reader and writer: round trips, one handcrafted corrupt file per rejection, every truncation, random
// damage, and the real SmolLM2 model.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "model/gguf.hpp"
#include "model/quant.hpp"

namespace test_gguf {

using namespace cascade::gguf;

namespace {

// Little-endian byte assembly for handcrafted files.
struct Bytes {
  std::vector<uint8_t> b;
  template <class T>
  Bytes& put(T v) {
    const size_t at = b.size();
    b.resize(at + sizeof(T));
    std::memcpy(b.data() + at, &v, sizeof(T));
    return *this;
  }
  Bytes& u8(uint8_t v) { return put(v); }
  Bytes& u32(uint32_t v) { return put(v); }
  Bytes& u64(uint64_t v) { return put(v); }
  Bytes& str(std::string_view s) {
    u64(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  Bytes& raw(const std::vector<uint8_t>& v) {
    b.insert(b.end(), v.begin(), v.end());
    return *this;
  }
  Bytes& pad_to(size_t alignment) {
    b.resize((b.size() + alignment - 1) / alignment * alignment, 0);
    return *this;
  }
  size_t size() const { return b.size(); }
};

Bytes header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
  Bytes h;
  h.b = {'G', 'G', 'U', 'F'};
  h.u32(version).u64(n_tensors).u64(n_kv);
  return h;
}

struct TensorSpec {
  std::string name;
  std::vector<uint64_t> ne;
  uint32_t type;
  uint64_t offset;
  uint32_t n_dims = 0;  // 0: ne.size()
};

// A file with the given key/value bytes (n_kv pairs), tensor infos and data_bytes of data.
std::vector<uint8_t> assemble(const Bytes& kvs, uint64_t n_kv, const std::vector<TensorSpec>& ts, size_t data_bytes,
                              size_t alignment = 32) {
  Bytes f = header(ts.size(), n_kv);
  f.raw(kvs.b);
  for (const TensorSpec& t : ts) {
    f.str(t.name).u32(t.n_dims ? t.n_dims : static_cast<uint32_t>(t.ne.size()));
    for (uint64_t d : t.ne) f.u64(d);
    f.u32(t.type).u64(t.offset);
  }
  f.pad_to(alignment);
  f.b.resize(f.b.size() + data_bytes, 0xAB);
  return f.b;
}

// The message of the Error from_bytes throws; fails the test if it accepts the bytes.
std::string rejection(std::vector<uint8_t> bytes) {
  try {
    File::from_bytes(std::move(bytes), "corrupt.gguf");
  } catch (const cascade::Error& e) {
    return e.what();
  }
  FAIL("the corrupt file was accepted");
  return {};
}

#define CHECK_REJECTS(bytes, word)                                                        \
  do {                                                                                    \
    const std::string msg_ = rejection(bytes);                                            \
    INFO("message: ", msg_);                                                              \
    CHECK(msg_.find(word) != std::string::npos);                                          \
    CHECK(msg_.find("corrupt.gguf") != std::string::npos);                                \
  } while (0)

size_t find_bytes(const std::vector<uint8_t>& b, std::string_view needle) {
  auto it = std::search(b.begin(), b.end(), needle.begin(), needle.end());
  REQUIRE(it != b.end());
  return static_cast<size_t>(it - b.begin());
}

template <class T>
void poke(std::vector<uint8_t>& b, size_t at, T v) {
  REQUIRE(at + sizeof(T) <= b.size());
  std::memcpy(b.data() + at, &v, sizeof(T));
}

std::vector<uint8_t> iota_bytes(size_t n, uint8_t start = 0) {
  std::vector<uint8_t> v(n);
  for (size_t k = 0; k < n; ++k) v[k] = static_cast<uint8_t>(start + k * 7);
  return v;
}

// A small valid file: a few keys and three tensors.
std::vector<uint8_t> small_file() {
  Writer w;
  w.set_string("general.architecture", "llama");
  w.set_u32("llama.block_count", 2);
  w.set_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.set_bool("tokenizer.ggml.add_bos_token", true);
  const std::vector<std::string> toks = {"a", "bc", ""};
  w.set_string_array("tokenizer.ggml.tokens", toks);
  const std::vector<int32_t> types = {1, 3, 6};
  w.set_int_array("tokenizer.ggml.token_type", types);
  const auto q = iota_bytes(2 * 20);
  w.add_tensor("blk.0.attn_q.weight", TensorType::Q4_1, {32, 2}, q.data());
  const std::vector<float> norm = {1, 2, 3, 4};
  w.add_tensor("output_norm.weight", TensorType::F32, {4}, norm.data());
  const auto q8 = iota_bytes(34, 3);
  w.add_tensor("token_embd.weight", TensorType::Q8_0, {32, 1}, q8.data());
  return w.to_bytes();
}

}  // namespace

// --- round trips -----------------------------------------------------------------------------------

TEST_CASE("gguf: writer to reader: every value type") {
  Writer w;
  w.set_u8("t.u8", 200).set_i8("t.i8", -5).set_u16("t.u16", 60000).set_i16("t.i16", -30000);
  w.set_u32("t.u32", 4000000000u).set_i32("t.i32", -7).set_i32("t.i32pos", 12);
  w.set_u64("t.u64", 1ull << 40).set_i64("t.i64", -(1ll << 40)).set_i64("t.i64pos", 1ll << 41);
  w.set_f32("t.f32", 0.125f).set_f64("t.f64", 1e-300).set_bool("t.true", true).set_bool("t.false", false);
  w.set_string("t.str", "h\xc3\xa9llo").set_string("t.empty", "");
  const std::vector<std::string> strs = {"x", "", "a b", std::string(300, 'z')};
  w.set_string_array("t.strs", strs);
  const std::vector<float> floats = {1.5f, -2.0f, 1e30f};
  w.set_float_array("t.floats", floats);
  const std::vector<int32_t> ints = {-1, 0, 2147483647};
  w.set_int_array("t.ints", ints);
  const uint8_t u8s[] = {0, 255};
  w.set_array("t.u8s", ValueType::U8, u8s, 2);
  const int8_t i8s[] = {-128, 127};
  w.set_array("t.i8s", ValueType::I8, i8s, 2);
  const uint32_t u32s[] = {7, 4000000000u};
  w.set_array("t.u32s", ValueType::U32, u32s, 2);
  const double f64s[] = {0.5, -1e100};
  w.set_array("t.f64s", ValueType::F64, f64s, 2);
  const uint8_t bools[] = {1, 0, 1};
  w.set_array("t.bools", ValueType::BOOL, bools, 3);
  w.set_array("t.none", ValueType::I16, nullptr, 0);
  w.set_u32("t.replaced", 1).set_string("t.replaced", "now a string");

  File f = File::from_bytes(w.to_bytes(), "roundtrip.gguf");
  CHECK(f.version() == 3);
  CHECK(f.alignment() == 32);
  CHECK(f.tensors().empty());
  CHECK(f.kvs().size() == 26);
  CHECK(f.kvs().front().key == "t.u8");

  CHECK(f.get_uint("t.u8") == 200);
  CHECK(f.get_uint("t.u16") == 60000);
  CHECK(f.get_uint("t.u32") == 4000000000u);
  CHECK(f.get_uint("t.u64") == (1ull << 40));
  CHECK(f.get_uint("t.i32pos") == 12);
  CHECK(f.get_uint("t.i64pos") == (1ull << 41));
  CHECK(f.get_int("t.i8") == -5);
  CHECK(f.get_int("t.i16") == -30000);
  CHECK(f.get_int("t.i32") == -7);
  CHECK(f.get_int("t.i64") == -(1ll << 40));
  CHECK(f.get_int("t.u32") == 4000000000ll);
  CHECK(f.get_float("t.f32") == 0.125f);
  CHECK(f.find("t.f64")->f == 1e-300);
  CHECK(f.get_float("t.f64") == static_cast<float>(1e-300));
  CHECK(f.get_bool("t.true"));
  CHECK(f.get_bool_opt("t.false") == false);
  CHECK(f.get_string("t.str") == "h\xc3\xa9llo");
  CHECK(f.get_string("t.empty").empty());
  CHECK(f.get_string("t.replaced") == "now a string");

  auto s = f.get_string_array("t.strs");
  REQUIRE(s.size() == 4);
  CHECK(s[0] == "x");
  CHECK(s[1].empty());
  CHECK(s[2] == "a b");
  CHECK(s[3] == std::string(300, 'z'));
  CHECK(f.get_float_array("t.floats") == floats);
  CHECK(f.get_float_array("t.f64s") == std::vector<float>{0.5f, static_cast<float>(-1e100)});
  CHECK(f.get_int_array("t.ints") == ints);
  CHECK(f.get_int_array("t.u8s") == std::vector<int32_t>{0, 255});
  CHECK(f.get_int_array("t.i8s") == std::vector<int32_t>{-128, 127});
  CHECK(f.get_int_array("t.none").empty());
  CHECK(f.find("t.bools")->count == 3);
  CHECK(f.find("t.bools")->elem_type == ValueType::BOOL);

  // optional forms
  CHECK_FALSE(f.get_uint_opt("nope").has_value());
  CHECK_FALSE(f.get_float_opt("nope").has_value());
  CHECK_FALSE(f.get_string_opt("nope").has_value());
  CHECK_FALSE(f.get_bool_opt("nope").has_value());
  CHECK(f.find("nope") == nullptr);
  CHECK(f.get_uint_opt("t.u8") == 200u);

  // wrong types and missing keys are errors naming the key
  auto message = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const cascade::Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  CHECK(message([&] { f.get_uint("nope"); }).find("missing key 'nope'") != std::string::npos);
  CHECK(message([&] { f.architecture(); }).find("general.architecture") != std::string::npos);
  CHECK(message([&] { f.get_uint("t.i32"); }).find("non-negative") != std::string::npos);
  CHECK(message([&] { f.get_uint("t.f32"); }).find("'t.f32' has type f32") != std::string::npos);
  CHECK(message([&] { f.get_uint_opt("t.str"); }).find("expected an unsigned integer") != std::string::npos);
  CHECK(message([&] { f.get_float("t.u32"); }).find("expected f32 or f64") != std::string::npos);
  CHECK(message([&] { f.get_string("t.u8"); }).find("expected string") != std::string::npos);
  CHECK(message([&] { f.get_bool_opt("t.u8"); }).find("expected bool") != std::string::npos);
  CHECK(message([&] { f.get_string_array("t.floats"); }).find("array of f32") != std::string::npos);
  CHECK(message([&] { f.get_float_array("t.ints"); }).find("t.ints") != std::string::npos);
  CHECK(message([&] { f.get_int_array("t.strs"); }).find("t.strs") != std::string::npos);
  CHECK(message([&] { f.get_int_array("t.u32s"); }).find("int32") != std::string::npos);
  CHECK(message([&] { f.get_int_array("t.u8"); }).find("array of integers") != std::string::npos);
}

TEST_CASE("gguf: writer to reader: tensors of several types, data identical") {
  struct T {
    std::string name;
    TensorType type;
    std::vector<int64_t> ne;
  };
  const std::vector<T> specs = {
      {"f32", TensorType::F32, {3, 5}},        {"f16", TensorType::F16, {7}},
      {"q8_0", TensorType::Q8_0, {64, 3}},     {"q4_1", TensorType::Q4_1, {32, 2, 2}},
      {"q4_k", TensorType::Q4_K, {256, 1, 1, 2}}, {"q6_k", TensorType::Q6_K, {512}},
      {"q2_k", TensorType::Q2_K, {256, 2}},    {"bf16", TensorType::BF16, {9, 1}},
  };
  for (uint32_t alignment : {32u, 64u, 1u}) {
    CAPTURE(alignment);
    Writer w;
    w.set_string("general.architecture", "test");
    if (alignment != 32) w.set_alignment(alignment);
    std::vector<std::vector<uint8_t>> datas;
    for (const T& s : specs) {
      uint64_t bytes = row_bytes(s.type, s.ne[0]);
      for (size_t d = 1; d < s.ne.size(); ++d) bytes *= static_cast<uint64_t>(s.ne[d]);
      datas.push_back(iota_bytes(bytes, static_cast<uint8_t>(datas.size() * 31)));
      w.add_tensor(s.name, s.type, s.ne, datas.back().data());
    }
    const std::vector<uint8_t> bytes = w.to_bytes();
    File f = File::from_bytes(bytes);
    CHECK(f.alignment() == alignment);
    CHECK(f.data_offset() % alignment == 0);
    REQUIRE(f.tensors().size() == specs.size());
    for (size_t k = 0; k < specs.size(); ++k) {
      const TensorInfo& t = f.tensors()[k];
      CAPTURE(t.name);
      CHECK(t.name == specs[k].name);
      CHECK(t.type == specs[k].type);
      CHECK(t.ne == specs[k].ne);
      CHECK(t.offset % alignment == 0);
      CHECK(t.n_bytes == datas[k].size());
      int64_t n = 1;
      for (int64_t d : specs[k].ne) n *= d;
      CHECK(t.n_elements == n);
      CHECK(f.find_tensor(specs[k].name) == &t);
      CHECK(std::memcmp(f.tensor_data(t), datas[k].data(), datas[k].size()) == 0);
    }
    CHECK(f.find_tensor("missing") == nullptr);
  }
}

TEST_CASE("gguf: open() maps a written file, a moved File keeps its views") {
  const std::string path = std::string(CASCADE_BINARY_DIR) + "/test_gguf_" + std::to_string(getpid()) + ".gguf";
  Writer w;
  w.set_string("general.architecture", "llama");
  const std::vector<float> v = {1, 2, 3, 4, 5, 6, 7, 8};
  w.add_tensor("w", TensorType::F32, {4, 2}, v.data());
  w.write(path);

  std::string_view arch;
  {
    File a = File::open(path);
    arch = a.architecture();
    CHECK(a.name() == path);
    File b = std::move(a);
    CHECK(b.architecture() == "llama");
    CHECK(arch.data() == b.architecture().data());
    const TensorInfo* t = b.find_tensor("w");
    REQUIRE(t);
    std::vector<float> out(8);
    dequantize_row(t->type, b.tensor_data(*t), out.data(), t->n_elements);
    CHECK(out == v);
    File c = File::from_bytes(small_file());
    c = std::move(b);
    CHECK(c.tensors().size() == 1);
  }
  std::filesystem::remove(path);

  try {
    File::open(path);
    FAIL("opening a missing file should throw");
  } catch (const cascade::Error& e) {
    CHECK(std::string(e.what()).find(path) != std::string::npos);
  }
}

TEST_CASE("gguf: a vocabulary-only file and version 2 are accepted") {
  Writer w;
  w.set_string("general.architecture", "llama");
  const std::vector<std::string> toks = {"<s>", "</s>"};
  w.set_string_array("tokenizer.ggml.tokens", toks);
  auto bytes = w.to_bytes();
  File f = File::from_bytes(bytes);
  CHECK(f.tensors().empty());
  CHECK(f.get_string_array("tokenizer.ggml.tokens").size() == 2);

  // without the trailing padding too: there is no data section to pad to
  Bytes b = header(0, 1);
  b.str("general.architecture").u32(8).str("llama");
  CHECK(File::from_bytes(b.b).architecture() == "llama");

  poke<uint32_t>(bytes, 4, 2);
  CHECK(File::from_bytes(bytes).version() == 2);
  CHECK(File::from_bytes(small_file()).find_tensor("output_norm.weight") != nullptr);
}

TEST_CASE("gguf: tensor name of 63 bytes is accepted") {
  const std::string name(63, 'n');
  auto bytes = assemble({}, 0, {{name, {4}, 0, 0}}, 32);
  CHECK(File::from_bytes(bytes).tensors()[0].name == name);
}

// --- rejections: header ------------------------------------------------------------------------------

TEST_CASE("gguf: reject: bad magic") {
  auto b = small_file();
  b[0] = 'X';
  CHECK_REJECTS(b, "magic");
  CHECK_REJECTS(std::vector<uint8_t>({'G', 'G', 'M', 'L', 3, 0, 0, 0}), "magic");
}

TEST_CASE("gguf: reject: version 1, 0 and above 3, big-endian files") {
  for (uint32_t v : {1u, 0u, 4u, 0xFFFFFFFFu}) {
    auto b = small_file();
    poke(b, 4, v);
    CHECK_REJECTS(b, "version");
  }
  auto b = small_file();
  poke<uint32_t>(b, 4, 0x03000000u);
  CHECK_REJECTS(b, "big-endian");
}

TEST_CASE("gguf: reject: tensor and key/value counts absurd for the file size") {
  auto b = small_file();
  poke<uint64_t>(b, 8, 1ull << 40);
  CHECK_REJECTS(b, "tensor count");
  b = small_file();
  poke<uint64_t>(b, 16, ~0ull);
  CHECK_REJECTS(b, "key/value count");
}

TEST_CASE("gguf: a rejection names the byte where the bad field starts") {
  // Handcrafted layouts: the header is 24 bytes (magic, version, two u64 counts); a key or tensor name "k"/"w"
  // takes 9 (u64 length + 1 byte).
  const auto at_byte = [](std::vector<uint8_t> bytes, const std::string& what, size_t at) {
    const std::string msg = rejection(std::move(bytes));
    INFO("message: ", msg);
    CHECK(msg.find(what) != std::string::npos);
    CHECK(msg.find("(at byte " + std::to_string(at) + ")") != std::string::npos);
  };
  auto b = small_file();
  poke<uint64_t>(b, 8, 1ull << 40);
  at_byte(b, "tensor count", 8);
  b = small_file();
  poke<uint64_t>(b, 16, ~0ull);
  at_byte(b, "key/value count", 16);
  Bytes t = header(0, 1);
  t.str("k").u32(13).u64(0);  // (8 more bytes, so the count is not absurd for what is left)
  at_byte(t.b, "unknown value type 13", 33);
  Bytes e = header(0, 1);
  e.str("k").u32(9).u32(7).u64(3).u8(0).u8(1).u8(0xFF);  // elements from byte 49
  at_byte(e.b, "bool element 2", 51);
  Bytes d = header(0, 2);
  d.str("k").u32(4).u32(1).str("k").u32(4).u32(2);  // the second pair from byte 41
  at_byte(d.b, "duplicate key", 41);
  // tensor info "w" at 24: n_dims at 33, ne[0] at 37, then ne[1] or the type, then the offset
  at_byte(assemble({}, 0, {{"w", {4, 0}, 0, 0}}, 64), "zero dimension ne[1]", 45);
  at_byte(assemble({}, 0, {{"w", {16, 2}, 3, 0}}, 64), "block size", 33);  // shape errors: where the dims start
  at_byte(assemble({}, 0, {{"w", {256}, 4, 0}}, 4096), "unknown tensor type 4", 45);
  at_byte(assemble({}, 0, {{"w", {8}, 0, 4}}, 64), "alignment", 49);
}

// --- rejections: key/value pairs ---------------------------------------------------------------------

TEST_CASE("gguf: reject: string length larger than what remains") {
  Bytes b = header(0, 1);
  b.u64(1ull << 40).b.resize(b.b.size() + 40, 'a');
  CHECK_REJECTS(b.b, "truncated");
  // a string value
  Bytes c = header(0, 1);
  c.str("k").u32(8).u64(~0ull);  // length 2^64-1: must not wrap when added to the position
  CHECK_REJECTS(c.b, "truncated");
  // an element of a string array
  Bytes d = header(0, 1);
  d.str("k").u32(9).u32(8).u64(2).str("ok").u64(1000);
  CHECK_REJECTS(d.b, "truncated");
}

TEST_CASE("gguf: reject: array count larger than what remains (and count * size overflow)") {
  for (uint64_t count : {1000ull, 1ull << 62, ~0ull}) {
    Bytes b = header(0, 1);
    b.str("k").u32(9).u32(4).u64(count).u32(1).u32(2);  // u32 elements: count * 4 wraps for 2^62
    CHECK_REJECTS(b.b, "array count");
    Bytes s = header(0, 1);
    s.str("k").u32(9).u32(8).u64(count).str("a");
    CHECK_REJECTS(s.b, "array count");
  }
}

TEST_CASE("gguf: reject: unknown value types") {
  Bytes b = header(0, 1);
  b.str("k").u32(13).u32(0);
  CHECK_REJECTS(b.b, "unknown value type 13");
  Bytes c = header(0, 1);
  c.str("k").u32(0x80000000u).u32(0);
  CHECK_REJECTS(c.b, "unknown value type");
  Bytes d = header(0, 1);
  d.str("k").u32(9).u32(42).u64(1).u32(0);
  CHECK_REJECTS(d.b, "unknown array element type 42");
}

TEST_CASE("gguf: reject: nested arrays") {
  Bytes b = header(0, 1);
  b.str("k").u32(9).u32(9).u64(1).u32(4).u64(1).u32(5);
  CHECK_REJECTS(b.b, "nested");
}

TEST_CASE("gguf: reject: bool byte other than 0 or 1") {
  auto w = Writer().set_bool("flag", true).to_bytes();
  File::from_bytes(w);  // valid as written
  const size_t at = find_bytes(w, "flag") + 4 + 4;  // key, then the u32 type, then the byte
  REQUIRE(w[at] == 1);
  w[at] = 2;
  CHECK_REJECTS(w, "bool");
  Bytes b = header(0, 1);
  b.str("k").u32(9).u32(7).u64(3).u8(0).u8(1).u8(0xFF);
  CHECK_REJECTS(b.b, "bool element 2");
}

TEST_CASE("gguf: reject: empty and duplicate keys") {
  Bytes b = header(0, 1);
  b.str("").u32(4).u32(1);
  CHECK_REJECTS(b.b, "empty key");
  Bytes c = header(0, 2);
  c.str("general.name").u32(8).str("a").str("general.name").u32(4).u32(1);
  CHECK_REJECTS(c.b, "duplicate key 'general.name'");
  // by patching a writer's file: rename the second key to the first
  auto w = Writer().set_u32("aaaa", 1).set_u32("bbbb", 2).to_bytes();
  std::memcpy(w.data() + find_bytes(w, "bbbb"), "aaaa", 4);
  CHECK_REJECTS(w, "duplicate key");
}

// --- rejections: alignment ---------------------------------------------------------------------------

TEST_CASE("gguf: reject: alignment that is 0, not a power of two, huge, or not u32") {
  for (uint32_t a : {0u, 3u, 48u, 1u << 21, 0x80000000u}) {
    CAPTURE(a);
    auto w = Writer().set_alignment(64).to_bytes();
    poke(w, find_bytes(w, "general.alignment") + 17 + 4, a);
    CHECK_REJECTS(w, "alignment");
  }
  Bytes b = header(0, 1);
  b.str("general.alignment").u32(10).u64(32);  // u64
  CHECK_REJECTS(b.b, "must be u32");
  Bytes c = header(0, 1);
  c.str("general.alignment").u32(5).u32(32);  // i32
  CHECK_REJECTS(c.b, "alignment");
}

// --- rejections: tensor infos ------------------------------------------------------------------------

TEST_CASE("gguf: reject: duplicate tensor names") {
  auto b = assemble({}, 0, {{"w", {32}, 0, 0}, {"w", {32}, 0, 128}}, 256);
  CHECK_REJECTS(b, "duplicate tensor name 'w'");
}

TEST_CASE("gguf: reject: tensor names of 64 bytes or more, and empty names") {
  CHECK_REJECTS(assemble({}, 0, {{std::string(64, 'n'), {4}, 0, 0}}, 16), "limit is 63");
  CHECK_REJECTS(assemble({}, 0, {{std::string(1000, 'n'), {4}, 0, 0}}, 16), "limit is 63");
  CHECK_REJECTS(assemble({}, 0, {{"", {4}, 0, 0}}, 16), "empty name");
}

TEST_CASE("gguf: reject: n_dims 0 or above 4") {
  CHECK_REJECTS(assemble({}, 0, {{"w", {}, 0, 0, 0}}, 0), "n_dims 0");
  auto zero = assemble({}, 0, {{"w", {}, 0, 0}}, 0);
  CHECK_REJECTS(zero, "n_dims");
  CHECK_REJECTS(assemble({}, 0, {{"w", {1, 1, 1, 1, 1}, 0, 0}}, 32), "n_dims 5");
  CHECK_REJECTS(assemble({}, 0, {{"w", {1, 1, 1}, 0, 0, 0xFFFFFFFFu}}, 32), "n_dims");
}

TEST_CASE("gguf: reject: zero, negative and overflowing dimensions") {
  CHECK_REJECTS(assemble({}, 0, {{"w", {4, 0}, 0, 0}}, 64), "zero dimension ne[1]");
  CHECK_REJECTS(assemble({}, 0, {{"w", {1ull << 63, 1}, 0, 0}}, 64), "negative");
  CHECK_REJECTS(assemble({}, 0, {{"w", {1ull << 32, 1ull << 32}, 0, 0}}, 64), "element count");
  CHECK_REJECTS(assemble({}, 0, {{"w", {1ull << 31, 1ull << 31, 4}, 0, 0}}, 64), "overflows int64");
  // elements fit in int64 but the bytes do not fit in 64 bits
  CHECK_REJECTS(assemble({}, 0, {{"w", {1ull << 62}, 0, 0}}, 64), "byte size");
  CHECK_REJECTS(assemble({}, 0, {{"w", {1ull << 20, 1ull << 20}, 0, 0}}, 64), "past the end");
}

TEST_CASE("gguf: reject: unknown tensor types") {
  for (uint32_t t : {4u, 5u, 31u, 40u, 1000u}) {
    CAPTURE(t);
    CHECK_REJECTS(assemble({}, 0, {{"w", {256}, t, 0}}, 4096), "unknown tensor type");
  }
  // by patching a writer's file: the type field follows the name, n_dims and one dimension
  std::vector<float> v(8);
  auto w = Writer().add_tensor("wxyz", TensorType::F32, {8}, v.data()).to_bytes();
  poke<uint32_t>(w, find_bytes(w, "wxyz") + 4 + 4 + 8, 77);
  CHECK_REJECTS(w, "unknown tensor type 77");
}

TEST_CASE("gguf: reject: first dimension not a multiple of the block size") {
  CHECK_REJECTS(assemble({}, 0, {{"w", {16, 2}, 3, 0}}, 64), "multiple");     // q4_1, blocks of 32
  CHECK_REJECTS(assemble({}, 0, {{"w", {128}, 12, 0}}, 256), "block size 256");  // q4_K
  CHECK_REJECTS(assemble({}, 0, {{"w", {32}, 10, 0}}, 256), "q2_K");          // known, not decodable
}

TEST_CASE("gguf: reject: offsets unaligned, out of order, overlapping or past the end") {
  // f32 {8}: 32 bytes each
  CHECK_REJECTS(assemble({}, 0, {{"a", {8}, 0, 4}}, 64), "alignment");
  CHECK_REJECTS(assemble({}, 0, {{"a", {8}, 0, 64}, {"b", {8}, 0, 0}}, 128), "out of order");
  CHECK_REJECTS(assemble({}, 0, {{"a", {16}, 0, 0}, {"b", {8}, 0, 32}}, 128), "overlaps tensor 'a'");
  CHECK_REJECTS(assemble({}, 0, {{"a", {8}, 0, 0}, {"b", {8}, 0, 0}}, 128), "overlaps");
  CHECK_REJECTS(assemble({}, 0, {{"a", {8}, 0, 0}, {"b", {8}, 0, 32}}, 63), "past the end");
  CHECK_REJECTS(assemble({}, 0, {{"a", {8}, 0, 1ull << 40}}, 64), "past the end");
  CHECK_REJECTS(assemble({}, 0, {{"a", {8}, 0, ~0ull - 31}}, 64), "past the end");  // offset + size wraps
  // with a custom alignment the offsets must follow it
  Bytes kv;
  kv.str("general.alignment").u32(4).u32(64);
  CHECK_REJECTS(assemble(kv, 1, {{"a", {8}, 0, 32}}, 128, 64), "alignment 64");
  CHECK(File::from_bytes(assemble(kv, 1, {{"a", {8}, 0, 64}}, 128, 64)).tensors()[0].offset == 64);
  // tensors but no room for the padded data section
  auto cut = assemble({}, 0, {{"a", {8}, 0, 0}}, 0);
  while (cut.size() % 32 == 0) cut.pop_back();
  CHECK_REJECTS(cut, "truncated");
}

// --- truncation and random damage --------------------------------------------------------------------

TEST_CASE("gguf: every truncation of a small valid file is rejected") {
  const auto full = small_file();
  File::from_bytes(full);
  for (size_t n = 0; n < full.size(); ++n) {
    CAPTURE(n);
    std::vector<uint8_t> cut(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    CHECK_THROWS_AS(File::from_bytes(cut, "cut.gguf"), cascade::Error);
  }
}

TEST_CASE("gguf: random damage never crashes: each result is an Error or a readable file") {
  const auto full = small_file();
  std::mt19937 rng(7);
  int accepted = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    auto b = full;
    const int n_flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < n_flips; ++k) {
      const size_t at = rng() % b.size();
      b[at] = rng() % 3 == 0 ? static_cast<uint8_t>(0xFF) : static_cast<uint8_t>(rng());
    }
    if (rng() % 4 == 0) b.resize(rng() % b.size());
    try {
      File f = File::from_bytes(std::move(b));
      ++accepted;
      for (const TensorInfo& t : f.tensors()) {
        if (!can_dequantize(t.type)) continue;
        std::vector<float> y(static_cast<size_t>(t.n_elements));
        dequantize_row(t.type, f.tensor_data(t), y.data(), t.n_elements);
      }
    } catch (const cascade::Error&) {
    }
  }
  CHECK(accepted > 0);  // damage to tensor data or string bytes is not detectable, and must stay readable
}

// --- the real model ----------------------------------------------------------------------------------

TEST_CASE("gguf: the SmolLM2-135M Q4_1 model opens and every tensor dequantizes") {
  const std::string path = CASCADE_MODEL_PATH;
  if (!std::filesystem::exists(path))
    FAIL(("model file " + path + " is missing: run `bash scripts/setup.sh` to fetch it"));
  File f = File::open(path);
  CHECK(f.architecture() == "llama");
  CHECK(f.get_uint("llama.block_count") == 30);
  CHECK(f.get_uint("llama.embedding_length") == 576);
  CHECK(f.get_uint("llama.attention.head_count") == 9);
  CHECK(f.get_uint("llama.attention.head_count_kv") == 3);
  CHECK(f.get_float("llama.attention.layer_norm_rms_epsilon") == doctest::Approx(1e-5));
  CHECK(f.get_string_array("tokenizer.ggml.tokens").size() == 49152);
  CHECK(f.get_string_opt("tokenizer.ggml.model") == "gpt2");
  CHECK(f.tensors().size() >= 270);
  CHECK(f.tensors().size() <= 275);
  CHECK(f.find_tensor("token_embd.weight") != nullptr);
  CHECK(f.find_tensor("blk.29.ffn_down.weight") != nullptr);

  std::set<TensorType> types;
  std::vector<float> row;
  int64_t n_total = 0;
  for (const TensorInfo& t : f.tensors()) {
    CAPTURE(t.name);
    types.insert(t.type);
    REQUIRE(can_dequantize(t.type));
    const int64_t n_rows = t.n_elements / t.ne[0];
    const uint64_t rb = row_bytes(t.type, t.ne[0]);
    REQUIRE(rb * static_cast<uint64_t>(n_rows) == t.n_bytes);
    row.resize(static_cast<size_t>(t.ne[0]));
    bool finite = true;
    double sum_sq = 0;
    for (int64_t r = 0; r < n_rows; ++r) {
      dequantize_row(t.type, f.tensor_data(t) + r * rb, row.data(), t.ne[0]);
      for (float v : row) {
        finite = finite && std::isfinite(v);
        sum_sq += static_cast<double>(v) * v;
      }
    }
    CHECK(finite);
    // trained weights have a modest scale: a misplaced block field would show up as huge or zero values
    const double rms = std::sqrt(sum_sq / static_cast<double>(t.n_elements));
    CHECK(rms > 1e-3);
    CHECK(rms < 10);
    n_total += t.n_elements;
  }
  CHECK(types.count(TensorType::Q4_1));
  CHECK(types.count(TensorType::Q8_0));
  CHECK(types.count(TensorType::F32));
  CHECK(n_total > 130'000'000);
  CHECK(n_total < 140'000'000);
}

}  // namespace test_gguf
