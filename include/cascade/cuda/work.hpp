// The device-side work list of the CUDA path (schedule.hpp builds it, kernel.cuh reads it): plain structs
// uploaded as bytes, shared by host and device code, with no dependency beyond <cstdint>.
#pragma once

#include <cstdint>

namespace cascade::cuda {

inline constexpr int kNarrow = 0;
inline constexpr int kWide = 1;
inline constexpr int kTileRows[2] = {16, 64};
// Shortest chunk of tokens one block takes when a pass is split across blocks.
inline constexpr int64_t kMinChunk = 512;
// Chunk boundaries fall on multiples of this (the kernels' largest KV tile).
inline constexpr int64_t kChunkAlign = 64;

// One pass's K/V on the device (uploaded as is; 64-bit pointers and strides in elements).
struct PassDesc {
  const void* k = nullptr;  // q8_0: the int8 codes
  const void* v = nullptr;
  const void* k_scales = nullptr;  // q8_0 only: f16 scales, that of codes [o, o + 32) at k_scales[o / 32]
  const void* v_scales = nullptr;
  const int32_t* block_table = nullptr;  // device copy; nullptr when contiguous
  int64_t stride_token = 0, stride_head = 0, stride_page = 0;
  int32_t n_tokens = 0;
  int32_t page_size = 0;   // 0 when contiguous
  int32_t row_begin = 0;   // the pass's token rows: rows[row_begin, row_begin + n_token_rows)
  int32_t n_token_rows = 0;
  int32_t vec16 = 0;       // 1: every K/V row starts 16-byte aligned, q8_0 codes 8-byte (vector loads allowed)
  int32_t pad = 0;
};

// One query token row of a pass. Plans: it sees the pass's tokens [first, limit). The unified buffer: it is a
// token of sequence `seq` at position `pos`, and sees the keys of its sequence at positions <= pos (and, under a
// sliding window, > pos - window: LaunchArgs::window).
struct RowDesc {
  int32_t q_row = 0;
  int32_t limit = 0;
  int32_t seq = 0;
  int32_t pos = 0;
  int32_t first = 0;
};

struct WorkItem {
  int32_t pass = 0;
  int32_t kvh = 0;
  int32_t e0 = 0;
  int32_t n_rows = 0;
  int32_t t0 = 0, t1 = 0;
  int64_t slot = 0;
};
static_assert(sizeof(WorkItem) == 32 && sizeof(RowDesc) == 20, "device structs are uploaded as bytes");

}  // namespace cascade::cuda
