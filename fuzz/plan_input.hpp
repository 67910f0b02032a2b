// The byte format fuzz_plan reads, shared with the seed writer so that seeds decode to the plans they mean.
// Every field is one byte unless noted; bytes past the end of the input read as 0.
//
//   flags        bits 0-1 K/V dtype (0 f32, 1 f16, 2 bf16, 3 f32), bit 2 "huge" (segment lengths are u64 and
//                the plan is only built, never run), bits 3-4 thread count - 1 for attend
//   n_q_heads    i8          (may be zero or negative: the plan must reject it)
//   n_kv_heads   i8
//   head_dim     u8          < 0xC0: itself; else 16 * (byte - 0xBF): 16, 32, ..., 1024 (64 = 0xC3, 128 = 0xC7)
//   scale        u8          0: the default 1/sqrt(head_dim); 254: NaN; 255: +inf; else (byte - 128) / 16
//   n_segments   u8
//   per segment:
//     n_tokens   u16 little-endian (u64 when huge)
//     page_size  u8          0: contiguous; else paged with pages of that many tokens (ignored when huge)
//     pad        u8          low nibble: extra elements between heads; high nibble: extra between tokens
//   n_sequences  u8
//   per sequence:
//     n_query    u8
//     path_len   u8
//     path       path_len x i8 segment ids (out-of-range and repeated ids must be rejected)
//   rest         seeds the values of q, K and V
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

namespace cascade::fuzz {

struct SegmentSpec {
  uint64_t n_tokens = 0;
  uint8_t page_size = 0;
  uint8_t pad = 0;
};

struct SequenceSpec {
  uint8_t n_query = 0;
  std::vector<int8_t> path;
};

struct PlanSpec {
  uint8_t dtype = 0;
  bool huge = false;
  uint8_t threads = 0;  // attend uses threads + 1
  int8_t n_q_heads = 0;
  int8_t n_kv_heads = 0;
  uint8_t head_dim = 0;
  uint8_t scale = 0;
  std::vector<SegmentSpec> segments;
  std::vector<SequenceSpec> sequences;
  uint64_t value_seed = 0;

  int head_dim_value() const { return head_dim < 0xC0 ? head_dim : 16 * (head_dim - 0xBF); }
};

class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint64_t le(int bytes) {
    uint64_t v = 0;
    for (int k = 0; k < bytes; ++k) v |= uint64_t(u8()) << (8 * k);
    return v;
  }
  uint64_t rest_hash() const {  // FNV-1a of what is left
    uint64_t h = 1469598103934665603ull;
    for (size_t k = pos_; k < size_; ++k) h = (h ^ data_[k]) * 1099511628211ull;
    return h;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

inline PlanSpec decode_plan(const uint8_t* data, size_t size) {
  ByteReader r(data, size);
  PlanSpec p;
  const uint8_t flags = r.u8();
  p.dtype = flags & 3;
  p.huge = (flags >> 2) & 1;
  p.threads = (flags >> 3) & 3;
  p.n_q_heads = int8_t(r.u8());
  p.n_kv_heads = int8_t(r.u8());
  p.head_dim = r.u8();
  p.scale = r.u8();
  p.segments.resize(r.u8());
  for (SegmentSpec& s : p.segments) {
    s.n_tokens = r.le(p.huge ? 8 : 2);
    s.page_size = r.u8();
    s.pad = r.u8();
  }
  p.sequences.resize(r.u8());
  for (SequenceSpec& s : p.sequences) {
    s.n_query = r.u8();
    s.path.resize(r.u8());
    for (int8_t& g : s.path) g = int8_t(r.u8());
  }
  p.value_seed = r.rest_hash();
  return p;
}

inline std::vector<uint8_t> encode_plan(const PlanSpec& p) {
  std::vector<uint8_t> out;
  out.push_back(uint8_t((p.dtype & 3) | (p.huge ? 4 : 0) | ((p.threads & 3) << 3)));
  out.push_back(uint8_t(p.n_q_heads));
  out.push_back(uint8_t(p.n_kv_heads));
  out.push_back(p.head_dim);
  out.push_back(p.scale);
  out.push_back(uint8_t(p.segments.size()));
  for (const SegmentSpec& s : p.segments) {
    for (int k = 0; k < (p.huge ? 8 : 2); ++k) out.push_back(uint8_t(s.n_tokens >> (8 * k)));
    out.push_back(s.page_size);
    out.push_back(s.pad);
  }
  out.push_back(uint8_t(p.sequences.size()));
  for (const SequenceSpec& s : p.sequences) {
    out.push_back(s.n_query);
    out.push_back(uint8_t(s.path.size()));
    for (int8_t g : s.path) out.push_back(uint8_t(g));
  }
  for (int k = 0; k < 8; ++k) out.push_back(uint8_t(p.value_seed >> (8 * k)));
  return out;
}

}  // namespace cascade::fuzz
