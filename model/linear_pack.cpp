// The rows16 layout of quantized weights (linear_kernels.hpp states it): packing a matrix's blocks of 16 rows,
// and reading one row back as the file stores it. Plain C++: a model packs once when it loads, and the products
// pack a block on the fly only for a matrix that was not packed.
//
// Packing goes through each file block's codes (gguf::decode_codes: unsigned, q8_0 as q + 128) and copies its
// scale fields bit for bit, so that a row read back is the file's bytes again (tests/test_linear.cpp).
#include "model/linear_kernels.hpp"

#include <tbb/parallel_for.h>

#include <cstring>

#include "cascade/error.hpp"
#include "model/quant.hpp"

namespace cascade::linear {

using gguf::TensorType;

namespace detail {

Rows16 rows16_offsets(TensorType t) {
  Rows16 o;
  switch (t) {
    case TensorType::Q4_0: o.chunks = 32; break;
    case TensorType::Q4_1: o.m = 32, o.chunks = 64; break;
    case TensorType::Q8_0: o.chunks = 32; break;
    case TensorType::Q4_K: o.m = 32, o.words = 64, o.chunks = 256; break;
    case TensorType::Q5_K: o.m = 32, o.words = 64, o.high = 256, o.chunks = 768; break;
    case TensorType::Q6_K: o.scales = 32, o.chunks = 288, o.high = 2336; break;
    default: ::cascade::detail::fail("linear: tensor type ", gguf::type_name(t), " has no rows16 layout");
  }
  return o;
}

namespace {

// Where a file block keeps the fields the rows16 layout copies as they are: its f16 d (and q4_1's m or the
// K-quants' dmin), the K-quants' 12 scale bytes, q6_K's 16 i8 scales. -1: none.
struct Fields {
  int d = 0, m = -1, words = -1, scales = -1;
};

Fields fields_of(TensorType t) {
  switch (t) {
    case TensorType::Q4_1: return {0, 2, -1, -1};
    case TensorType::Q4_K: case TensorType::Q5_K: return {0, 2, 4, -1};
    case TensorType::Q6_K: return {208, -1, -1, 192};
    default: return {0, -1, -1, -1};
  }
}

// Row j of a super-column (16 file blocks of type t at sc) from the block at src, codes its decoded codes.
void put_row(TensorType t, const uint8_t* src, const uint8_t* code, int j, uint8_t* sc) {
  const Rows16 o = rows16_offsets(t);
  const Fields f = fields_of(t);
  const int64_t bs = gguf::block_size(t);
  std::memcpy(sc + o.d + 2 * j, src + f.d, 2);
  if (f.m >= 0) std::memcpy(sc + o.m + 2 * j, src + f.m, 2);
  if (f.words >= 0)
    for (int w = 0; w < 3; ++w) std::memcpy(sc + o.words + 64 * w + 4 * j, src + f.words + 4 * w, 4);
  if (f.scales >= 0)
    for (int g = 0; g < 16; ++g) sc[o.scales + 16 * g + j] = src[f.scales + g];
  uint8_t* chunks = sc + o.chunks + 4 * j;
  if (t == TensorType::Q8_0) {
    for (int z = 0; z < 8; ++z) std::memcpy(chunks + 64 * z, code + 4 * z, 4);
    return;
  }
  for (int64_t z = 0; z < bs / 8; ++z)
    for (int e = 0; e < 4; ++e) chunks[64 * z + e] = uint8_t((code[8 * z + e] & 15) | (code[8 * z + 4 + e] & 15) << 4);
  uint8_t* high = sc + o.high + 4 * j;
  if (t == TensorType::Q5_K) {
    for (int v = 0; v < 8; ++v)
      for (int e = 0; e < 4; ++e) {
        int bits = 0;
        for (int s = 0; s < 4; ++s) {
          const uint8_t* c = code + 8 * (4 * v + s);
          bits |= ((c[e] >> 4) & 1) << (2 * s) | ((c[4 + e] >> 4) & 1) << (2 * s + 1);
        }
        high[64 * v + e] = uint8_t(bits);
      }
  } else if (t == TensorType::Q6_K) {
    for (int v = 0; v < 16; ++v)
      for (int e = 0; e < 4; ++e) {
        int bits = 0;
        for (int s = 0; s < 2; ++s) {
          const uint8_t* c = code + 8 * (2 * v + s);
          bits |= ((c[e] >> 4) & 3) << (4 * s) | ((c[4 + e] >> 4) & 3) << (4 * s + 2);
        }
        high[64 * v + e] = uint8_t(bits);
      }
  }
}

// The codes of row j of a super-column, as gguf::decode_codes gives them (put_row's inverse).
void get_codes(TensorType t, const uint8_t* sc, int j, uint8_t* code) {
  const Rows16 o = rows16_offsets(t);
  const int64_t bs = gguf::block_size(t);
  const uint8_t* chunks = sc + o.chunks + 4 * j;
  if (t == TensorType::Q8_0) {
    for (int z = 0; z < 8; ++z) std::memcpy(code + 4 * z, chunks + 64 * z, 4);
    return;
  }
  for (int64_t z = 0; z < bs / 8; ++z)
    for (int e = 0; e < 4; ++e) {
      code[8 * z + e] = chunks[64 * z + e] & 15;
      code[8 * z + 4 + e] = chunks[64 * z + e] >> 4;
    }
  const uint8_t* high = sc + o.high + 4 * j;
  if (t == TensorType::Q5_K) {
    for (int64_t z = 0; z < 32; ++z)
      for (int e = 0; e < 4; ++e) {
        const int bits = high[64 * (z / 4) + e], s = int(z % 4);
        code[8 * z + e] = uint8_t(code[8 * z + e] | ((bits >> (2 * s)) & 1) << 4);
        code[8 * z + 4 + e] = uint8_t(code[8 * z + 4 + e] | ((bits >> (2 * s + 1)) & 1) << 4);
      }
  } else if (t == TensorType::Q6_K) {
    for (int64_t z = 0; z < 32; ++z)
      for (int e = 0; e < 4; ++e) {
        const int bits = high[64 * (z / 2) + e], s = int(z % 2);
        code[8 * z + e] = uint8_t(code[8 * z + e] | ((bits >> (4 * s)) & 3) << 4);
        code[8 * z + 4 + e] = uint8_t(code[8 * z + 4 + e] | ((bits >> (4 * s + 2)) & 3) << 4);
      }
  }
}

// The file's code bytes of one block of type t from its codes (decode_codes' inverse; quant.hpp states where
// each type keeps them). The scale fields are not touched.
void encode_codes(TensorType t, const uint8_t* code, uint8_t* b) {
  switch (t) {
    case TensorType::Q4_0: case TensorType::Q4_1: {
      uint8_t* qs = b + (t == TensorType::Q4_0 ? 2 : 4);
      for (int j = 0; j < 16; ++j) qs[j] = uint8_t(code[j] | code[j + 16] << 4);
      break;
    }
    case TensorType::Q8_0:
      for (int j = 0; j < 32; ++j) b[2 + j] = uint8_t(code[j] ^ 0x80);
      break;
    case TensorType::Q4_K: case TensorType::Q5_K: {
      const bool q5 = t == TensorType::Q5_K;
      uint8_t* qs = b + (q5 ? 48 : 16);
      if (q5) std::memset(b + 16, 0, 32);
      for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
          const uint8_t lo = code[64 * c + l], hi = code[64 * c + 32 + l];
          qs[32 * c + l] = uint8_t((lo & 15) | (hi & 15) << 4);
          if (q5) b[16 + l] = uint8_t(b[16 + l] | ((lo >> 4) & 1) << (2 * c) | ((hi >> 4) & 1) << (2 * c + 1));
        }
      break;
    }
    case TensorType::Q6_K:
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
          const uint8_t* c = code + 128 * h;
          b[64 * h + l] = uint8_t((c[l] & 15) | (c[64 + l] & 15) << 4);
          b[64 * h + 32 + l] = uint8_t((c[32 + l] & 15) | (c[96 + l] & 15) << 4);
          b[128 + 32 * h + l] = uint8_t((c[l] >> 4) | (c[32 + l] >> 4) << 2 | (c[64 + l] >> 4) << 4 | (c[96 + l] >> 4) << 6);
        }
      break;
    default: ::cascade::detail::fail("linear: tensor type ", gguf::type_name(t), " has no rows16 layout");
  }
}

// Row j of a super-column back into the file block b (block_bytes(t) bytes).
void get_row(TensorType t, const uint8_t* sc, int j, uint8_t* b) {
  const Rows16 o = rows16_offsets(t);
  const Fields f = fields_of(t);
  uint8_t code[256];
  std::memcpy(b + f.d, sc + o.d + 2 * j, 2);
  if (f.m >= 0) std::memcpy(b + f.m, sc + o.m + 2 * j, 2);
  if (f.words >= 0)
    for (int w = 0; w < 3; ++w) std::memcpy(b + f.words + 4 * w, sc + o.words + 64 * w + 4 * j, 4);
  if (f.scales >= 0)
    for (int g = 0; g < 16; ++g) b[f.scales + g] = sc[o.scales + 16 * g + j];
  get_codes(t, sc, j, code);
  encode_codes(t, code, b);
}

}  // namespace

void pack_block(const Matrix& w, int64_t i, uint8_t* dst) {
  const TensorType t = w.type;
  const int64_t bs = gguf::block_size(t), n_blocks = w.n_in / bs;
  const uint64_t bb = gguf::block_bytes(t);
  std::memset(dst, 0, size_t(16 * w.row_bytes));
  uint8_t code[256];
  float sc[16], off[16];
  for (int j = 0; j < 16 && i + j < w.n_out; ++j) {
    const uint8_t* row = w.data + uint64_t(i + j) * w.row_bytes;
    for (int64_t b = 0; b < n_blocks; ++b) {
      gguf::decode_codes(t, row + b * bb, bs, code, sc, off);
      put_row(t, row + b * bb, code, j, dst + b * 16 * bb);
    }
  }
}

const uint8_t* block_at(const Matrix& w, int64_t i, uint8_t* scratch) {
  if (w.layout == Layout::rows16 && i + 16 <= w.n_out) return w.data + uint64_t(i) * w.row_bytes;
  if (w.layout == Layout::rows16) {
    // the last rows, as stored: packed here from a view of them
    Matrix tail = w;
    tail.layout = Layout::rows;
    tail.data = w.data + uint64_t(i) * w.row_bytes;
    tail.n_out = w.n_out - i;
    pack_block(tail, 0, scratch);
  } else {
    pack_block(w, i, scratch);
  }
  return scratch;
}

}  // namespace detail

bool can_pack(TensorType t) {
  switch (t) {
    case TensorType::Q4_0: case TensorType::Q4_1: case TensorType::Q8_0:
    case TensorType::Q4_K: case TensorType::Q5_K: case TensorType::Q6_K: return true;
    default: return false;
  }
}

Matrix pack(const Matrix& w, uint8_t* dst) {
  CASCADE_CHECK(can_pack(w.type), "linear: tensor type ", gguf::type_name(w.type), " is not packed in rows of 16");
  CASCADE_CHECK(w.layout == Layout::rows, "linear: the matrix is packed already");
  CASCADE_CHECK(dst + w.bytes() <= w.data || w.data + w.bytes() <= dst, "linear: pack into the matrix itself");
  const int64_t n_blocks = w.n_out / 16;
  tbb::parallel_for(int64_t(0), n_blocks, [&](int64_t r) {
    detail::pack_block(w, 16 * r, dst + uint64_t(16 * r) * w.row_bytes);
  });
  const uint64_t done = uint64_t(16 * n_blocks) * w.row_bytes;
  std::memcpy(dst + done, w.data + done, size_t(w.bytes() - done));
  Matrix p = w;
  p.data = dst;
  p.layout = Layout::rows16;
  return p;
}

const uint8_t* Matrix::row_blocks(int64_t i, uint8_t* scratch) const {
  CASCADE_CHECK(i >= 0 && i < n_out, "linear: row ", i, " of a matrix of ", n_out, " rows");
  if (layout == Layout::rows || i >= n_out / 16 * 16) return data + uint64_t(i) * row_bytes;
  const uint64_t bb = gguf::block_bytes(type);
  const int64_t n_blocks = n_in / gguf::block_size(type);
  const uint8_t* block = data + uint64_t(i / 16 * 16) * row_bytes;
  for (int64_t b = 0; b < n_blocks; ++b) detail::get_row(type, block + b * 16 * bb, int(i % 16), scratch + b * bb);
  return scratch;
}

}  // namespace cascade::linear
