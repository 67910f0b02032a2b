// GGUF model files: a validating, memory-mapped reader and a writer.
//
// Layout (all integers little-endian; "string" = u64 byte length, then that many bytes, no NUL):
//
//   u32     magic            the bytes 'G' 'G' 'U' 'F'
//   u32     version          2 or 3 (version 1 used u32 counts and is not read here)
//   u64     tensor_count
//   u64     kv_count
//   kv_count key/value pairs:
//           string key       non-empty, unique
//           u32    type      ValueType below
//           value            scalars are stored raw (BOOL is one byte, 0 or 1), STRING as a string,
//                            ARRAY as u32 element type + u64 count + the elements (no arrays of arrays)
//   tensor_count tensor infos:
//           string name      unique, shorter than 64 bytes
//           u32    n_dims    1..4
//           u64    ne[n_dims]  elements per dimension, ne[0] varies fastest
//           u32    type      TensorType below
//           u64    offset    relative to the data section, a multiple of the alignment
//   padding  zero bytes up to the next multiple of the alignment (`general.alignment`, u32, default 32)
//   data section: the tensors, each at its offset, in the order of the infos, padded to the alignment.
//
// Every field is checked before it is used: a damaged or hostile file becomes a cascade::Error that names
// the file, what was wrong and where (byte offset, key or tensor name), never an out-of-bounds read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace cascade::gguf {

// Metadata value types, numbered as in the file.
enum class ValueType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
};
const char* value_type_name(ValueType t);  // "u32", "string", ...; "unknown" outside the list
size_t value_type_size(ValueType t);       // bytes of a fixed-size value; 0 for STRING, ARRAY, unknown

// Tensor element types, numbered as ggml numbers them. Numbers ggml has retired are not listed.
enum class TensorType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23,
  I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
};
bool is_known(TensorType t);             // listed above, so its block layout is known
const char* type_name(TensorType t);     // "q4_1", ...; "unknown" for numbers not listed
int64_t block_size(TensorType t);        // elements per block (1 for plain types); 0 if unknown
uint64_t block_bytes(TensorType t);      // bytes per block; 0 if unknown
// Bytes of n elements (n a multiple of block_size); throws on an unknown type or a partial block.
uint64_t row_bytes(TensorType t, int64_t n);

// One metadata value. Strings and array elements point into the file's bytes: valid while the File lives.
struct Value {
  ValueType type{};
  uint64_t u = 0;          // U8, U16, U32, U64, BOOL
  int64_t i = 0;           // I8, I16, I32, I64
  double f = 0;            // F32, F64
  std::string_view str;    // STRING

  ValueType elem_type{};   // ARRAY: element type (never ARRAY)
  uint64_t count = 0;      // ARRAY: number of elements
  const uint8_t* elems = nullptr;          // ARRAY of fixed-size elements: count * size bytes, little-endian
  std::vector<std::string_view> strings;   // ARRAY of STRING

  bool is_array() const { return type == ValueType::ARRAY; }
  // The value as an unsigned integer: any unsigned type, or a signed one that is not negative.
  std::optional<uint64_t> as_uint() const;
  // The value as a signed integer: any signed type, or an unsigned one that fits in int64.
  std::optional<int64_t> as_int() const;
  // The value as a float: F32 or F64 only.
  std::optional<double> as_float() const;
  // Element k of a numeric array, converted like as_int / as_float. k < count is the caller's job.
  std::optional<int64_t> elem_int(uint64_t k) const;
  std::optional<double> elem_float(uint64_t k) const;
};

struct KeyValue {
  std::string_view key;
  Value value;
};

struct TensorInfo {
  std::string name;
  std::vector<int64_t> ne;   // elements per dimension, ne[0] fastest; 1..4 entries, all >= 1
  TensorType type{};
  uint64_t offset = 0;       // from the start of the data section
  uint64_t n_bytes = 0;      // size of the data
  int64_t n_elements = 0;    // product of ne
};

// A GGUF file, validated when opened. Movable, not copyable; views handed out live as long as it.
class File {
 public:
  static File open(const std::string& path);  // memory-maps the file read-only
  static File from_bytes(std::vector<uint8_t> bytes, std::string name = "<memory>");

  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  const std::string& name() const { return name_; }
  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // byte where the data section starts
  size_t size() const { return size_; }                   // bytes in the file

  // --- metadata ---
  const std::vector<KeyValue>& kvs() const { return kvs_; }  // in file order
  const Value* find(std::string_view key) const;              // nullptr if absent
  // Typed getters: a missing key or a value of the wrong type throws an Error naming the file and key.
  // The _opt forms return nullopt for a missing key but still throw on a wrong type.
  uint64_t get_uint(std::string_view key) const;  // u8/u16/u32/u64, or i8..i64 when >= 0
  std::optional<uint64_t> get_uint_opt(std::string_view key) const;
  int64_t get_int(std::string_view key) const;    // any integer type that fits in int64
  std::optional<int64_t> get_int_opt(std::string_view key) const;
  float get_float(std::string_view key) const;    // f32 or f64
  std::optional<float> get_float_opt(std::string_view key) const;
  std::string_view get_string(std::string_view key) const;
  std::optional<std::string_view> get_string_opt(std::string_view key) const;
  bool get_bool(std::string_view key) const;
  std::optional<bool> get_bool_opt(std::string_view key) const;
  std::vector<std::string_view> get_string_array(std::string_view key) const;
  std::vector<float> get_float_array(std::string_view key) const;   // f32 or f64 elements
  std::vector<int32_t> get_int_array(std::string_view key) const;   // any integer elements that fit
  std::string_view architecture() const { return get_string("general.architecture"); }

  // --- tensors ---
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;  // nullptr if absent
  // First byte of the tensor's data; its n_bytes are inside the file (checked when opened).
  const uint8_t* tensor_data(const TensorInfo& t) const { return data_ + data_offset_ + t.offset; }
  // Says that the whole pages within [p, p + n) of a memory-mapped file will not be read for a while: they leave
  // the process's memory, and a later read brings them back from the file. Nothing for bytes held in memory
  // (from_bytes) or outside the file.
  void drop_pages(const uint8_t* p, uint64_t n) const;

 private:
  File() = default;
  void parse();
  void release() noexcept;
  const Value& require(std::string_view key) const;
  [[noreturn]] void wrong_type(std::string_view key, const Value& v, const char* expected) const;

  std::string name_;
  std::vector<uint8_t> owned_;    // from_bytes: the bytes themselves
  void* map_ = nullptr;           // open: the mapping (nullptr for an empty file)
  size_t map_len_ = 0;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;

  uint32_t version_ = 0;
  uint32_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<KeyValue> kvs_;
  std::unordered_map<std::string_view, size_t> kv_index_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

// Builds GGUF files (version 3). Setting a key again replaces its value in place; tensor data is copied.
class Writer {
 public:
  Writer& set_u8(std::string_view key, uint8_t v);
  Writer& set_i8(std::string_view key, int8_t v);
  Writer& set_u16(std::string_view key, uint16_t v);
  Writer& set_i16(std::string_view key, int16_t v);
  Writer& set_u32(std::string_view key, uint32_t v);
  Writer& set_i32(std::string_view key, int32_t v);
  Writer& set_u64(std::string_view key, uint64_t v);
  Writer& set_i64(std::string_view key, int64_t v);
  Writer& set_f32(std::string_view key, float v);
  Writer& set_f64(std::string_view key, double v);
  Writer& set_bool(std::string_view key, bool v);
  Writer& set_string(std::string_view key, std::string_view v);
  Writer& set_string_array(std::string_view key, std::span<const std::string> v);
  Writer& set_string_array(std::string_view key, std::span<const std::string_view> v);
  Writer& set_float_array(std::string_view key, std::span<const float> v);
  Writer& set_int_array(std::string_view key, std::span<const int32_t> v);
  // An array of any fixed-size element type: count elements of value_type_size(elem) bytes each.
  Writer& set_array(std::string_view key, ValueType elem, const void* data, uint64_t count);
  // A value read from a File, of any type, as it is there (copying a file's keys).
  Writer& set_value(std::string_view key, const Value& v);
  // Also stores `general.alignment`; a power of two.
  Writer& set_alignment(uint32_t alignment);

  // data holds row_bytes(type, ne[0]) * ne[1] * ... bytes.
  Writer& add_tensor(std::string name, TensorType type, std::vector<int64_t> ne, const void* data);

  std::vector<uint8_t> to_bytes() const;
  void write(const std::string& path) const;

 private:
  struct Entry {
    std::string key;
    ValueType type;
    std::vector<uint8_t> payload;  // everything after the type field
  };
  struct Tensor {
    std::string name;
    TensorType type;
    std::vector<int64_t> ne;
    std::vector<uint8_t> data;
  };
  Writer& set_raw(std::string_view key, ValueType type, std::vector<uint8_t> payload);

  uint32_t alignment_ = 32;
  std::vector<Entry> entries_;
  std::vector<Tensor> tensors_;
};

}  // namespace cascade::gguf
