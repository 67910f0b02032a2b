#include "model/gguf.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <unordered_set>

#include "cascade/error.hpp"

static_assert(std::endian::native == std::endian::little, "the GGUF reader assumes a little-endian host");

namespace cascade::gguf {

namespace {

struct TypeTraits {
  const char* name;
  int64_t block_size;
  uint64_t block_bytes;
};

// Block geometry of every known tensor type (ggml's type_traits); name nullptr = unknown number.
constexpr TypeTraits kTypes[] = {
    {"f32", 1, 4},            // 0
    {"f16", 1, 2},            // 1
    {"q4_0", 32, 18},         // 2: f16 d + 16 bytes of nibbles
    {"q4_1", 32, 20},         // 3: f16 d, f16 m + 16
    {nullptr, 0, 0},          // 4: retired
    {nullptr, 0, 0},          // 5: retired
    {"q5_0", 32, 22},         // 6: f16 d + 4 bytes high bits + 16
    {"q5_1", 32, 24},         // 7: f16 d, f16 m + 4 + 16
    {"q8_0", 32, 34},         // 8: f16 d + 32 i8
    {"q8_1", 32, 36},         // 9: f16 d, f16 s + 32 i8
    {"q2_K", 256, 84},        // 10
    {"q3_K", 256, 110},       // 11
    {"q4_K", 256, 144},       // 12
    {"q5_K", 256, 176},       // 13
    {"q6_K", 256, 210},       // 14
    {"q8_K", 256, 292},       // 15: f32 d + 256 i8 + 16 i16 sums
    {"iq2_xxs", 256, 66},     // 16
    {"iq2_xs", 256, 74},      // 17
    {"iq3_xxs", 256, 98},     // 18
    {"iq1_s", 256, 50},       // 19
    {"iq4_nl", 32, 18},       // 20
    {"iq3_s", 256, 110},      // 21
    {"iq2_s", 256, 82},       // 22
    {"iq4_xs", 256, 136},     // 23
    {"i8", 1, 1},             // 24
    {"i16", 1, 2},            // 25
    {"i32", 1, 4},            // 26
    {"i64", 1, 8},            // 27
    {"f64", 1, 8},            // 28
    {"iq1_m", 256, 56},       // 29
    {"bf16", 1, 2},           // 30
    {nullptr, 0, 0},          // 31: retired
    {nullptr, 0, 0},          // 32: retired
    {nullptr, 0, 0},          // 33: retired
    {"tq1_0", 256, 54},       // 34
    {"tq2_0", 256, 66},       // 35
    {nullptr, 0, 0},          // 36: retired
    {nullptr, 0, 0},          // 37: retired
    {nullptr, 0, 0},          // 38: retired
    {"mxfp4", 32, 17},        // 39: e8m0 scale + 16 bytes of nibbles
};

const TypeTraits* traits(TensorType t) {
  auto k = static_cast<uint32_t>(t);
  if (k >= std::size(kTypes) || kTypes[k].name == nullptr) return nullptr;
  return &kTypes[k];
}

constexpr uint64_t kMaxAlignment = 1u << 20;
constexpr size_t kMaxTensorName = 64;  // names must be shorter (ggml's GGML_MAX_NAME)
constexpr uint32_t kMaxDims = 4;

// Smallest encodings, used to reject counts that cannot fit in what is left of the file.
constexpr uint64_t kMinKvBytes = 8 + 1 + 4 + 1;         // key length, 1-byte key, type, 1-byte value
constexpr uint64_t kMinTensorInfoBytes = 8 + 1 + 4 + 8 + 4 + 8;  // name, n_dims, one dim, type, offset

template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

std::string quoted(std::string_view s) {
  std::string out = "'";
  for (char c : s) {
    auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[u >> 4];
      out += hex[u & 15];
    } else {
      out += c;
    }
  }
  if (out.size() > 80) out = out.substr(0, 77) + "...";
  return out + "'";
}

// An error about the file: "gguf file 'NAME': ", then args.
template <class... Args>
[[noreturn]] void fail_in(const std::string& file, Args&&... args) {
  detail::fail("gguf file ", quoted(file), ": ", std::forward<Args>(args)...);
}

// Reads little-endian fields from the file's bytes, failing with the file name and offset on truncation.
class Cursor {
 public:
  Cursor(const uint8_t* data, size_t size, const std::string& name) : data_(data), size_(size), name_(name) {}

  size_t pos() const { return pos_; }
  size_t left() const { return size_ - pos_; }

  template <class... Args>
  [[noreturn]] void fail_at(size_t at, Args&&... args) const {
    fail_in(name_, std::forward<Args>(args)..., " (at byte ", at, ")");
  }

  void need(uint64_t n, std::string_view what) const {
    if (n > left())
      fail_at(pos_, "truncated: ", what, " needs ", n, " bytes but only ", left(), " remain in the file");
  }

  template <class T>
  T read(std::string_view what) {
    need(sizeof(T), what);
    T v = load<T>(data_ + pos_);
    pos_ += sizeof(T);
    return v;
  }

  std::string_view read_string(std::string_view what) {
    size_t at = pos_;
    auto len = read<uint64_t>(what);
    if (len > left())
      fail_at(at, "truncated: ", what, " has length ", len, " but only ", left(), " bytes remain in the file");
    std::string_view s(reinterpret_cast<const char*>(data_ + pos_), len);
    pos_ += len;
    return s;
  }

  const uint8_t* skip(uint64_t n, std::string_view what) {
    need(n, what);
    const uint8_t* p = data_ + pos_;
    pos_ += n;
    return p;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& name_;
};

bool is_valid_value_type(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::F64); }

// Reads one fixed-size scalar of type t at p into v.
void decode_scalar(ValueType t, const uint8_t* p, Value& v) {
  switch (t) {
    case ValueType::U8: v.u = load<uint8_t>(p); break;
    case ValueType::I8: v.i = load<int8_t>(p); break;
    case ValueType::U16: v.u = load<uint16_t>(p); break;
    case ValueType::I16: v.i = load<int16_t>(p); break;
    case ValueType::U32: v.u = load<uint32_t>(p); break;
    case ValueType::I32: v.i = load<int32_t>(p); break;
    case ValueType::F32: v.f = load<float>(p); break;
    case ValueType::BOOL: v.u = load<uint8_t>(p); break;
    case ValueType::U64: v.u = load<uint64_t>(p); break;
    case ValueType::I64: v.i = load<int64_t>(p); break;
    case ValueType::F64: v.f = load<double>(p); break;
    default: break;
  }
}

bool is_unsigned(ValueType t) {
  return t == ValueType::U8 || t == ValueType::U16 || t == ValueType::U32 || t == ValueType::U64;
}
bool is_signed(ValueType t) {
  return t == ValueType::I8 || t == ValueType::I16 || t == ValueType::I32 || t == ValueType::I64;
}

}  // namespace

// --- type tables ---------------------------------------------------------------------------------

const char* value_type_name(ValueType t) {
  static const char* names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool",
                                "string", "array", "u64", "i64", "f64"};
  auto k = static_cast<uint32_t>(t);
  return k < std::size(names) ? names[k] : "unknown";
}

size_t value_type_size(ValueType t) {
  switch (t) {
    case ValueType::U8: case ValueType::I8: case ValueType::BOOL: return 1;
    case ValueType::U16: case ValueType::I16: return 2;
    case ValueType::U32: case ValueType::I32: case ValueType::F32: return 4;
    case ValueType::U64: case ValueType::I64: case ValueType::F64: return 8;
    default: return 0;
  }
}

bool is_known(TensorType t) { return traits(t) != nullptr; }

const char* type_name(TensorType t) {
  const TypeTraits* tt = traits(t);
  return tt ? tt->name : "unknown";
}

int64_t block_size(TensorType t) {
  const TypeTraits* tt = traits(t);
  return tt ? tt->block_size : 0;
}

uint64_t block_bytes(TensorType t) {
  const TypeTraits* tt = traits(t);
  return tt ? tt->block_bytes : 0;
}

uint64_t row_bytes(TensorType t, int64_t n) {
  const TypeTraits* tt = traits(t);
  CASCADE_CHECK(tt, "unknown tensor type ", static_cast<uint32_t>(t));
  CASCADE_CHECK(n >= 0 && n % tt->block_size == 0, "a row of ", n, " ", tt->name,
                " values is not a whole number of blocks of ", tt->block_size);
  uint64_t bytes;
  CASCADE_CHECK(!__builtin_mul_overflow(static_cast<uint64_t>(n / tt->block_size), tt->block_bytes, &bytes),
                "a row of ", n, " ", tt->name, " values overflows 64 bits");
  return bytes;
}

// --- Value ---------------------------------------------------------------------------------------

std::optional<uint64_t> Value::as_uint() const {
  if (is_unsigned(type)) return u;
  if (is_signed(type) && i >= 0) return static_cast<uint64_t>(i);
  return std::nullopt;
}

std::optional<int64_t> Value::as_int() const {
  if (is_signed(type)) return i;
  if (is_unsigned(type) && u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return static_cast<int64_t>(u);
  return std::nullopt;
}

std::optional<double> Value::as_float() const {
  if (type == ValueType::F32 || type == ValueType::F64) return f;
  return std::nullopt;
}

std::optional<int64_t> Value::elem_int(uint64_t k) const {
  if (!is_array() || elems == nullptr || k >= count) return std::nullopt;
  Value v;
  v.type = elem_type;
  decode_scalar(elem_type, elems + k * value_type_size(elem_type), v);
  return v.as_int();
}

std::optional<double> Value::elem_float(uint64_t k) const {
  if (!is_array() || elems == nullptr || k >= count) return std::nullopt;
  Value v;
  v.type = elem_type;
  decode_scalar(elem_type, elems + k * value_type_size(elem_type), v);
  return v.as_float();
}

// --- File: lifetime ------------------------------------------------------------------------------

File File::open(const std::string& path) {
  File f;
  f.name_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  CASCADE_CHECK(fd >= 0, "cannot open gguf file ", quoted(path), ": ", std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    detail::fail("cannot stat gguf file ", quoted(path), ": ", std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    detail::fail("gguf file ", quoted(path), " is not a regular file");
  }
  f.size_ = static_cast<size_t>(st.st_size);
  if (f.size_ > 0) {
    void* p = mmap(nullptr, f.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      detail::fail("cannot map gguf file ", quoted(path), ": ", std::strerror(e));
    }
    f.map_ = p;
    f.map_len_ = f.size_;
    f.data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
  f.parse();
  return f;
}

File File::from_bytes(std::vector<uint8_t> bytes, std::string name) {
  File f;
  f.name_ = std::move(name);
  f.owned_ = std::move(bytes);
  f.data_ = f.owned_.data();
  f.size_ = f.owned_.size();
  f.parse();
  return f;
}

// Moving a vector or a mapping keeps its bytes where they are, so the views into them stay valid.
File::File(File&& o) noexcept
    : name_(std::move(o.name_)),
      owned_(std::move(o.owned_)),
      map_(o.map_),
      map_len_(o.map_len_),
      data_(o.data_),
      size_(o.size_),
      version_(o.version_),
      alignment_(o.alignment_),
      data_offset_(o.data_offset_),
      kvs_(std::move(o.kvs_)),
      kv_index_(std::move(o.kv_index_)),
      tensors_(std::move(o.tensors_)),
      tensor_index_(std::move(o.tensor_index_)) {
  o.map_ = nullptr;
  o.map_len_ = 0;
  o.data_ = nullptr;
  o.size_ = 0;
}

File& File::operator=(File&& o) noexcept {
  if (this != &o) {
    release();
    name_ = std::move(o.name_);
    owned_ = std::move(o.owned_);
    map_ = o.map_;
    map_len_ = o.map_len_;
    data_ = o.data_;
    size_ = o.size_;
    version_ = o.version_;
    alignment_ = o.alignment_;
    data_offset_ = o.data_offset_;
    kvs_ = std::move(o.kvs_);
    kv_index_ = std::move(o.kv_index_);
    tensors_ = std::move(o.tensors_);
    tensor_index_ = std::move(o.tensor_index_);
    o.map_ = nullptr;
    o.map_len_ = 0;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

File::~File() { release(); }

void File::drop_pages(const uint8_t* p, uint64_t n) const {
  const auto* map = static_cast<const uint8_t*>(map_);
  if (map == nullptr || p < map || n > map_len_ || p - map > std::ptrdiff_t(map_len_ - n)) return;
  const auto page = uint64_t(sysconf(_SC_PAGESIZE));
  const uint64_t lo = (uint64_t(p - map) + page - 1) / page * page, hi = (uint64_t(p - map) + n) / page * page;
  if (hi > lo) madvise(const_cast<uint8_t*>(map + lo), hi - lo, MADV_DONTNEED);  // a read-only private mapping
}

void File::release() noexcept {
  if (map_ != nullptr) munmap(map_, map_len_);
  map_ = nullptr;
  map_len_ = 0;
}

// --- File: parsing -------------------------------------------------------------------------------

namespace {

// The magic and the version (2 or 3): versions 1 and big-endian files get an error of their own.
uint32_t read_version(Cursor& c, const uint8_t* data) {
  c.need(4, "the magic");
  if (std::memcmp(data, "GGUF", 4) != 0) {
    static const char* hex = "0123456789abcdef";
    std::string found;
    for (int k = 0; k < 4; ++k) {
      found += hex[data[k] >> 4];
      found += hex[data[k] & 15];
    }
    c.fail_at(0, "bad magic: expected 'GGUF' (47475546), found ", found);
  }
  c.skip(4, "the magic");
  const auto version = c.read<uint32_t>("the version");
  if (version == 1) c.fail_at(4, "GGUF version 1 is not supported (only versions 2 and 3)");
  if (version != 2 && version != 3) {
    const uint32_t swapped = __builtin_bswap32(version);
    if (swapped == 2 || swapped == 3)
      c.fail_at(4, "big-endian GGUF files are not supported (version field reads ", version, ")");
    c.fail_at(4, "unsupported GGUF version ", version, " (only versions 2 and 3)");
  }
  return version;
}

struct Counts {
  uint64_t n_tensors = 0;
  uint64_t n_kv = 0;
};

// The tensor and key/value counts, each no larger than the bytes left could hold.
Counts read_counts(Cursor& c) {
  const size_t at = c.pos();
  Counts n;
  n.n_tensors = c.read<uint64_t>("the tensor count");
  n.n_kv = c.read<uint64_t>("the key/value count");
  if (n.n_kv > c.left() / kMinKvBytes)
    c.fail_at(at + 8, "key/value count ", n.n_kv, " is absurd for a file with ", c.left(), " bytes left");
  if (n.n_tensors > c.left() / kMinTensorInfoBytes)
    c.fail_at(at, "tensor count ", n.n_tensors, " is absurd for a file with ", c.left(), " bytes left");
  return n;
}

// An ARRAY value after its type field: element type, count, then the elements (v.strings for strings,
// v.elems for fixed-size ones, bools 0 or 1).
void read_array(Cursor& c, const std::string& what, Value& v) {
  const size_t elem_at = c.pos();
  const auto elem = c.read<uint32_t>("the array element type of " + what);
  if (elem == static_cast<uint32_t>(ValueType::ARRAY)) c.fail_at(elem_at, "nested array (array of arrays) in ", what);
  if (!is_valid_value_type(elem)) c.fail_at(elem_at, "unknown array element type ", elem, " for ", what);
  v.elem_type = static_cast<ValueType>(elem);
  const size_t count_at = c.pos();
  v.count = c.read<uint64_t>("the array length of " + what);
  // Every element takes at least `least` bytes (a string: its length field).
  const size_t least = v.elem_type == ValueType::STRING ? 8 : value_type_size(v.elem_type);
  if (v.count > c.left() / least)
    c.fail_at(count_at, "truncated: array count ", v.count, " of ", what, " is larger than the ", c.left(),
              " bytes left in the file can hold");
  if (v.elem_type == ValueType::STRING) {
    v.strings.reserve(v.count);
    for (uint64_t e = 0; e < v.count; ++e)
      v.strings.push_back(c.read_string("element " + std::to_string(e) + " of " + what));
    return;
  }
  v.elems = c.skip(v.count * least, "the elements of " + what);
  if (v.elem_type != ValueType::BOOL) return;
  for (uint64_t e = 0; e < v.count; ++e)
    if (v.elems[e] > 1)
      c.fail_at(count_at + 8 + e, "bool element ", e, " of ", what, " is ", int(v.elems[e]), ", not 0 or 1");
}

// A value: its type field, then a string, an array or a scalar (a bool 0 or 1).
Value read_value(Cursor& c, const std::string& what) {
  Value v;
  const size_t type_at = c.pos();
  const auto type = c.read<uint32_t>("the value type of " + what);
  if (!is_valid_value_type(type)) c.fail_at(type_at, "unknown value type ", type, " for ", what);
  v.type = static_cast<ValueType>(type);
  if (v.type == ValueType::STRING) {
    v.str = c.read_string("the string value of " + what);
  } else if (v.type == ValueType::ARRAY) {
    read_array(c, what, v);
  } else {
    const size_t val_at = c.pos();
    const uint8_t* p = c.skip(value_type_size(v.type), "the value of " + what);
    decode_scalar(v.type, p, v);
    if (v.type == ValueType::BOOL && v.u > 1) c.fail_at(val_at, "bool value of ", what, " is ", v.u, ", not 0 or 1");
  }
  return v;
}

// n key/value pairs into kvs (file order) and index (key -> position in kvs); keys non-empty and unique.
void read_key_values(Cursor& c, uint64_t n, std::vector<KeyValue>& kvs,
                     std::unordered_map<std::string_view, size_t>& index) {
  kvs.reserve(n);
  index.reserve(n);
  for (uint64_t k = 0; k < n; ++k) {
    const size_t kv_at = c.pos();
    const std::string_view key = c.read_string("the key of key/value pair #" + std::to_string(k));
    if (key.empty()) c.fail_at(kv_at, "empty key in key/value pair #", k);
    if (index.count(key)) c.fail_at(kv_at, "duplicate key ", quoted(key));
    Value v = read_value(c, "key " + quoted(key));
    index.emplace(key, kvs.size());
    kvs.push_back({key, std::move(v)});
  }
}

// The alignment `general.alignment` sets: a u32 power of two, at most kMaxAlignment.
uint32_t alignment_of(const Value& a, const std::string& file) {
  if (a.type != ValueType::U32) fail_in(file, "key 'general.alignment' must be u32, found ", value_type_name(a.type));
  if (a.u == 0 || (a.u & (a.u - 1)) != 0 || a.u > kMaxAlignment)
    fail_in(file, "bad alignment ", a.u, " in 'general.alignment' (must be a power of two, at most ", kMaxAlignment,
            ")");
  return static_cast<uint32_t>(a.u);
}

// Tensor #k's name: non-empty, shorter than kMaxTensorName, not in index.
std::string read_tensor_name(Cursor& c, uint64_t k, const std::unordered_map<std::string, size_t>& index) {
  const size_t at = c.pos();
  const std::string_view name = c.read_string("the name of tensor #" + std::to_string(k));
  if (name.empty()) c.fail_at(at, "tensor #", k, " has an empty name");
  if (name.size() >= kMaxTensorName)
    c.fail_at(at, "tensor name ", quoted(name), " is ", name.size(), " bytes long (the limit is ", kMaxTensorName - 1,
              ")");
  std::string out(name);
  if (index.count(out)) c.fail_at(at, "duplicate tensor name ", quoted(name));
  return out;
}

// n_dims, then the dimensions into t.ne and their product into t.n_elements: 1 to kMaxDims of them, each
// at least 1, the product within int64.
void read_dims(Cursor& c, const std::string& what, TensorInfo& t) {
  const size_t dims_at = c.pos();
  const auto n_dims = c.read<uint32_t>("the n_dims of " + what);
  if (n_dims == 0 || n_dims > kMaxDims)
    c.fail_at(dims_at, what, " has n_dims ", n_dims, " (must be 1 to ", kMaxDims, ")");
  t.n_elements = 1;
  for (uint32_t d = 0; d < n_dims; ++d) {
    const size_t ne_at = c.pos();
    const auto ne = c.read<uint64_t>("a dimension of " + what);
    if (ne == 0) c.fail_at(ne_at, what, " has a zero dimension ne[", d, "]");
    if (ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      c.fail_at(ne_at, what, " has a negative or huge dimension ne[", d, "] = ", ne);
    t.ne.push_back(static_cast<int64_t>(ne));
    if (__builtin_mul_overflow(t.n_elements, static_cast<int64_t>(ne), &t.n_elements))
      c.fail_at(ne_at, "the element count of ", what, " overflows int64");
  }
}

// The type field into t.type, and t.n_bytes from it and t.ne: a known type, ne[0] whole blocks, the size
// within 64 bits. Shape errors point at dims_at, where the dimensions start.
void read_tensor_type(Cursor& c, const std::string& what, size_t dims_at, TensorInfo& t) {
  const size_t type_at = c.pos();
  const auto type = c.read<uint32_t>("the type of " + what);
  t.type = static_cast<TensorType>(type);
  const TypeTraits* tt = traits(t.type);
  if (!tt) c.fail_at(type_at, "unknown tensor type ", type, " for ", what);
  if (t.ne[0] % tt->block_size != 0)
    c.fail_at(dims_at, what, " has ne[0] = ", t.ne[0], ", not a multiple of the ", tt->name, " block size ",
              tt->block_size);
  uint64_t n_bytes;
  if (__builtin_mul_overflow(static_cast<uint64_t>(t.ne[0] / tt->block_size), tt->block_bytes, &n_bytes))
    c.fail_at(dims_at, "the byte size of ", what, " overflows 64 bits");
  for (size_t d = 1; d < t.ne.size(); ++d)
    if (__builtin_mul_overflow(n_bytes, static_cast<uint64_t>(t.ne[d]), &n_bytes))
      c.fail_at(dims_at, "the byte size of ", what, " overflows 64 bits");
  t.n_bytes = n_bytes;
}

// Tensor info #k: name, dimensions, type and a data offset that is a multiple of the alignment.
TensorInfo read_tensor_info(Cursor& c, uint64_t k, uint32_t alignment,
                            const std::unordered_map<std::string, size_t>& index) {
  TensorInfo t;
  t.name = read_tensor_name(c, k, index);
  const std::string what = "tensor " + quoted(t.name);
  const size_t dims_at = c.pos();
  read_dims(c, what, t);
  read_tensor_type(c, what, dims_at, t);
  const size_t off_at = c.pos();
  t.offset = c.read<uint64_t>("the data offset of " + what);
  if (t.offset % alignment != 0)
    c.fail_at(off_at, what, " has data offset ", t.offset, ", not a multiple of the alignment ", alignment);
  return t;
}

// The tensors' data in a data section of data_size bytes: in the order of the infos, no overlaps, each
// padded to the alignment within the section.
void check_extents(const std::vector<TensorInfo>& tensors, uint64_t data_size, uint32_t alignment,
                   const std::string& file) {
  uint64_t prev_end = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : tensors) {
    const std::string what = "tensor " + quoted(t.name);
    if (prev && t.offset < prev->offset)
      fail_in(file, what, " at data offset ", t.offset, " is out of order (it comes after tensor ", quoted(prev->name),
              " at ", prev->offset, ")");
    if (prev && t.offset < prev_end)
      fail_in(file, what, " at data offset ", t.offset, " overlaps tensor ", quoted(prev->name), " which ends at ",
              prev_end);
    // Writers pad every tensor, the last one included, to the alignment; a file without that padding was cut.
    uint64_t end, padded_end;
    if (__builtin_add_overflow(t.offset, t.n_bytes, &end) ||
        __builtin_add_overflow(end, uint64_t{alignment - 1}, &padded_end) ||
        padded_end / alignment * alignment > data_size)
      fail_in(file, what, " (", t.n_bytes, " bytes at data offset ", t.offset, ", padded to ", alignment,
              ") extends past the end of the file: the data section holds ", data_size, " bytes");
    prev_end = end;
    prev = &t;
  }
}

}  // namespace

void File::parse() {
  Cursor c(data_, size_, name_);
  version_ = read_version(c, data_);
  const Counts n = read_counts(c);
  read_key_values(c, n.n_kv, kvs_, kv_index_);
  if (const Value* a = find("general.alignment")) alignment_ = alignment_of(*a, name_);

  tensors_.reserve(n.n_tensors);
  tensor_index_.reserve(n.n_tensors);
  for (uint64_t k = 0; k < n.n_tensors; ++k) {
    TensorInfo t = read_tensor_info(c, k, alignment_, tensor_index_);
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment.
  const uint64_t end_of_infos = c.pos();
  data_offset_ = (end_of_infos + alignment_ - 1) / alignment_ * alignment_;  // no wrap: end <= size
  if (tensors_.empty()) return;  // a vocabulary-only file needs no data section
  if (data_offset_ > size_)
    c.fail_at(end_of_infos, "truncated: the data section should start at byte ", data_offset_, " but the file has ",
              size_, " bytes");
  check_extents(tensors_, size_ - data_offset_, alignment_, name_);
}

// --- File: access --------------------------------------------------------------------------------

const Value* File::find(std::string_view key) const {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kvs_[it->second].value;
}

namespace {

// What a getter without _opt returns: the _opt getter's answer, which is empty only for a missing key.
template <class T>
T required(const File& f, std::string_view key, std::optional<T> v) {
  if (!v) fail_in(f.name(), "missing key ", quoted(key));
  return *v;
}

}  // namespace

const Value& File::require(std::string_view key) const {
  const Value* v = find(key);
  if (!v) fail_in(name_, "missing key ", quoted(key));
  return *v;
}

void File::wrong_type(std::string_view key, const Value& v, const char* expected) const {
  std::string found = value_type_name(v.type);
  if (v.is_array()) found += std::string(" of ") + value_type_name(v.elem_type);
  fail_in(name_, "key ", quoted(key), " has type ", found, ", expected ", expected);
}

std::optional<uint64_t> File::get_uint_opt(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (auto u = v->as_uint()) return u;
  if (is_signed(v->type))
    fail_in(name_, "key ", quoted(key), " is ", v->i, ", expected a non-negative value");
  wrong_type(key, *v, "an unsigned integer");
}

uint64_t File::get_uint(std::string_view key) const { return required(*this, key, get_uint_opt(key)); }

std::optional<int64_t> File::get_int_opt(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (auto i = v->as_int()) return i;
  if (is_unsigned(v->type))
    fail_in(name_, "key ", quoted(key), " is ", v->u, ", too large for int64");
  wrong_type(key, *v, "an integer");
}

int64_t File::get_int(std::string_view key) const { return required(*this, key, get_int_opt(key)); }

std::optional<float> File::get_float_opt(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (auto f = v->as_float()) return static_cast<float>(*f);
  wrong_type(key, *v, "f32 or f64");
}

float File::get_float(std::string_view key) const { return required(*this, key, get_float_opt(key)); }

std::optional<std::string_view> File::get_string_opt(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::STRING) wrong_type(key, *v, "string");
  return v->str;
}

std::string_view File::get_string(std::string_view key) const { return required(*this, key, get_string_opt(key)); }

std::optional<bool> File::get_bool_opt(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::BOOL) wrong_type(key, *v, "bool");
  return v->u != 0;
}

bool File::get_bool(std::string_view key) const { return required(*this, key, get_bool_opt(key)); }

std::vector<std::string_view> File::get_string_array(std::string_view key) const {
  const Value& v = require(key);
  if (!v.is_array() || v.elem_type != ValueType::STRING) wrong_type(key, v, "array of string");
  return v.strings;
}

std::vector<float> File::get_float_array(std::string_view key) const {
  const Value& v = require(key);
  if (!v.is_array() || (v.elem_type != ValueType::F32 && v.elem_type != ValueType::F64))
    wrong_type(key, v, "array of f32 or f64");
  std::vector<float> out(v.count);
  for (uint64_t k = 0; k < v.count; ++k) out[k] = static_cast<float>(*v.elem_float(k));
  return out;
}

std::vector<int32_t> File::get_int_array(std::string_view key) const {
  const Value& v = require(key);
  if (!v.is_array() || !(is_signed(v.elem_type) || is_unsigned(v.elem_type)))
    wrong_type(key, v, "array of integers");
  std::vector<int32_t> out(v.count);
  for (uint64_t k = 0; k < v.count; ++k) {
    std::optional<int64_t> x = v.elem_int(k);
    if (!x || *x < std::numeric_limits<int32_t>::min() || *x > std::numeric_limits<int32_t>::max())
      fail_in(name_, "element ", k, " of key ", quoted(key), " does not fit in int32");
    out[k] = static_cast<int32_t>(*x);
  }
  return out;
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

// --- Writer --------------------------------------------------------------------------------------

namespace {

// resize + memcpy rather than insert: GCC 12 at -O1 (the sanitizer builds) flags inserting a 1-byte scalar's
// bytes as an overflow (-Wstringop-overflow), a false positive.
template <class T>
void put(std::vector<uint8_t>& out, T v) {
  const size_t at = out.size();
  out.resize(at + sizeof(T));
  std::memcpy(out.data() + at, &v, sizeof(T));
}

void put_string(std::vector<uint8_t>& out, std::string_view s) {
  put<uint64_t>(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}

template <class T>
std::vector<uint8_t> scalar(T v) {
  std::vector<uint8_t> out;
  put(out, v);
  return out;
}

}  // namespace

Writer& Writer::set_raw(std::string_view key, ValueType type, std::vector<uint8_t> payload) {
  CASCADE_CHECK(!key.empty(), "gguf writer: empty key");
  for (Entry& e : entries_) {
    if (e.key == key) {
      e.type = type;
      e.payload = std::move(payload);
      return *this;
    }
  }
  entries_.push_back({std::string(key), type, std::move(payload)});
  return *this;
}

Writer& Writer::set_u8(std::string_view key, uint8_t v) { return set_raw(key, ValueType::U8, scalar(v)); }
Writer& Writer::set_i8(std::string_view key, int8_t v) { return set_raw(key, ValueType::I8, scalar(v)); }
Writer& Writer::set_u16(std::string_view key, uint16_t v) { return set_raw(key, ValueType::U16, scalar(v)); }
Writer& Writer::set_i16(std::string_view key, int16_t v) { return set_raw(key, ValueType::I16, scalar(v)); }
Writer& Writer::set_u32(std::string_view key, uint32_t v) {
  if (key == "general.alignment") {
    CASCADE_CHECK(v != 0 && (v & (v - 1)) == 0 && v <= kMaxAlignment, "gguf writer: bad alignment ", v);
    alignment_ = v;
  }
  return set_raw(key, ValueType::U32, scalar(v));
}
Writer& Writer::set_i32(std::string_view key, int32_t v) { return set_raw(key, ValueType::I32, scalar(v)); }
Writer& Writer::set_u64(std::string_view key, uint64_t v) { return set_raw(key, ValueType::U64, scalar(v)); }
Writer& Writer::set_i64(std::string_view key, int64_t v) { return set_raw(key, ValueType::I64, scalar(v)); }
Writer& Writer::set_f32(std::string_view key, float v) { return set_raw(key, ValueType::F32, scalar(v)); }
Writer& Writer::set_f64(std::string_view key, double v) { return set_raw(key, ValueType::F64, scalar(v)); }
Writer& Writer::set_bool(std::string_view key, bool v) {
  return set_raw(key, ValueType::BOOL, scalar<uint8_t>(v ? 1 : 0));
}
Writer& Writer::set_string(std::string_view key, std::string_view v) {
  std::vector<uint8_t> p;
  put_string(p, v);
  return set_raw(key, ValueType::STRING, std::move(p));
}

Writer& Writer::set_string_array(std::string_view key, std::span<const std::string> v) {
  std::vector<std::string_view> views(v.begin(), v.end());
  return set_string_array(key, std::span<const std::string_view>(views));
}

Writer& Writer::set_string_array(std::string_view key, std::span<const std::string_view> v) {
  std::vector<uint8_t> p;
  put<uint32_t>(p, static_cast<uint32_t>(ValueType::STRING));
  put<uint64_t>(p, v.size());
  for (std::string_view s : v) put_string(p, s);
  return set_raw(key, ValueType::ARRAY, std::move(p));
}

Writer& Writer::set_float_array(std::string_view key, std::span<const float> v) {
  return set_array(key, ValueType::F32, v.data(), v.size());
}

Writer& Writer::set_int_array(std::string_view key, std::span<const int32_t> v) {
  return set_array(key, ValueType::I32, v.data(), v.size());
}

Writer& Writer::set_array(std::string_view key, ValueType elem, const void* data, uint64_t count) {
  const size_t esize = value_type_size(elem);
  CASCADE_CHECK(esize != 0, "gguf writer: set_array needs a fixed-size element type, not ", value_type_name(elem));
  std::vector<uint8_t> p;
  put<uint32_t>(p, static_cast<uint32_t>(elem));
  put<uint64_t>(p, count);
  const auto* b = static_cast<const uint8_t*>(data);
  if (count) p.insert(p.end(), b, b + count * esize);
  return set_raw(key, ValueType::ARRAY, std::move(p));
}

Writer& Writer::set_value(std::string_view key, const Value& v) {
  switch (v.type) {
    case ValueType::U8: return set_u8(key, uint8_t(v.u));
    case ValueType::I8: return set_i8(key, int8_t(v.i));
    case ValueType::U16: return set_u16(key, uint16_t(v.u));
    case ValueType::I16: return set_i16(key, int16_t(v.i));
    case ValueType::U32: return set_u32(key, uint32_t(v.u));
    case ValueType::I32: return set_i32(key, int32_t(v.i));
    case ValueType::U64: return set_u64(key, v.u);
    case ValueType::I64: return set_i64(key, v.i);
    case ValueType::F32: return set_f32(key, float(v.f));
    case ValueType::F64: return set_f64(key, v.f);
    case ValueType::BOOL: return set_bool(key, v.u != 0);
    case ValueType::STRING: return set_string(key, v.str);
    case ValueType::ARRAY:
      if (v.elem_type == ValueType::STRING) return set_string_array(key, std::span<const std::string_view>(v.strings));
      return set_array(key, v.elem_type, v.elems, v.count);
  }
  detail::fail("gguf writer: key ", quoted(std::string(key)), " has an unknown value type ", uint32_t(v.type));
}

Writer& Writer::set_alignment(uint32_t alignment) { return set_u32("general.alignment", alignment); }

Writer& Writer::add_tensor(std::string name, TensorType type, std::vector<int64_t> ne, const void* data) {
  CASCADE_CHECK(!name.empty() && name.size() < kMaxTensorName, "gguf writer: bad tensor name ", quoted(name));
  for (const Tensor& t : tensors_)
    CASCADE_CHECK(t.name != name, "gguf writer: duplicate tensor name ", quoted(name));
  CASCADE_CHECK(is_known(type), "gguf writer: unknown tensor type ", static_cast<uint32_t>(type));
  CASCADE_CHECK(!ne.empty() && ne.size() <= kMaxDims, "gguf writer: tensor ", quoted(name), " has ", ne.size(),
                " dimensions");
  for (int64_t d : ne) CASCADE_CHECK(d > 0, "gguf writer: tensor ", quoted(name), " has a dimension ", d);
  uint64_t bytes = row_bytes(type, ne[0]);
  for (size_t d = 1; d < ne.size(); ++d)
    CASCADE_CHECK(!__builtin_mul_overflow(bytes, static_cast<uint64_t>(ne[d]), &bytes),
                  "gguf writer: tensor ", quoted(name), " is too large");
  const auto* b = static_cast<const uint8_t*>(data);
  tensors_.push_back({std::move(name), type, std::move(ne), std::vector<uint8_t>(b, b + bytes)});
  return *this;
}

std::vector<uint8_t> Writer::to_bytes() const {
  const auto pad = [&](std::vector<uint8_t>& out) {
    out.resize((out.size() + alignment_ - 1) / alignment_ * alignment_, 0);
  };
  std::vector<uint8_t> out(4);
  std::memcpy(out.data(), "GGUF", 4);
  put<uint32_t>(out, 3);
  put<uint64_t>(out, tensors_.size());
  put<uint64_t>(out, entries_.size());
  for (const Entry& e : entries_) {
    put_string(out, e.key);
    put<uint32_t>(out, static_cast<uint32_t>(e.type));
    out.insert(out.end(), e.payload.begin(), e.payload.end());
  }
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    put_string(out, t.name);
    put<uint32_t>(out, static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) put<uint64_t>(out, static_cast<uint64_t>(d));
    put<uint32_t>(out, static_cast<uint32_t>(t.type));
    put<uint64_t>(out, offset);
    offset += (t.data.size() + alignment_ - 1) / alignment_ * alignment_;
  }
  pad(out);
  for (const Tensor& t : tensors_) {
    out.insert(out.end(), t.data.begin(), t.data.end());
    pad(out);
  }
  return out;
}

void Writer::write(const std::string& path) const {
  const std::vector<uint8_t> bytes = to_bytes();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  CASCADE_CHECK(f, "cannot create gguf file ", quoted(path), ": ", std::strerror(errno));
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  f.close();
  CASCADE_CHECK(f, "cannot write gguf file ", quoted(path), ": ", std::strerror(errno));
}

}  // namespace cascade::gguf
