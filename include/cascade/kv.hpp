// A view of the keys and values of one KV span (a segment of the cascade tree): n_tokens tokens,
// n_kv_heads heads, head_dim values each, for K and V alike. The view does not own memory.
//
// Contiguous storage (token-major, any strides, in ELEMENTS):
//   K(t, h, i) = k[t * stride_token + h * stride_head + i]          (same for V with v)
// Paged storage (a block table of fixed-size pages, as in vLLM and FlashInfer):
//   page = block_table[t / page_size], slot = t % page_size
//   K(t, h, i) = k[page * stride_page + slot * stride_token + h * stride_head + i]
// The innermost dimension (i < head_dim) is always dense.
//
// q8_0 K/V (q8_0.hpp): k and v hold the int8 codes as above (offsets in codes, that is bytes), and k_scales and
// v_scales the f16 scales, laid out as the codes are at 1/32 of their offsets: the scale of codes [o, o + 32) is
// scales[o / 32], for o = offset(t, h) + i, i a multiple of 32. So head_dim and every stride are multiples of 32,
// and the scales of codes stored (n_tokens, n_kv_heads, head_dim) are (n_tokens, n_kv_heads, head_dim / 32);
// paged codes (page, page_size, n_kv_heads, head_dim) have scales (page, page_size, n_kv_heads, head_dim / 32)
// under the same block table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cascade/dtype.hpp"
#include "cascade/error.hpp"
#include "cascade/q8_0.hpp"

namespace cascade {

// Bytes of one token's K (or V) of n_kv_heads heads of head_dim elements of type dt, stored dense: the elements,
// and q8_0's scales.
inline int64_t kv_row_bytes(DType dt, int64_t n_kv_heads, int64_t head_dim) {
  return n_kv_heads * head_dim * dtype_size(dt) + (dt == DType::q8_0 ? n_kv_heads * head_dim / kQ8Block * 2 : 0);
}

struct KvView {
  DType dtype = DType::f32;
  int64_t n_tokens = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  const void* k = nullptr;  // element type = dtype (q8_0: the int8 codes)
  const void* v = nullptr;
  const void* k_scales = nullptr;  // q8_0 only: f16 scales, one per 32 codes (above)
  const void* v_scales = nullptr;
  int64_t stride_token = 0;
  int64_t stride_head = 0;
  // Paged only (block_table != nullptr): ceil(n_tokens / page_size) page ids.
  const int32_t* block_table = nullptr;
  int64_t page_size = 0;
  int64_t stride_page = 0;

  bool paged() const { return block_table != nullptr; }

  // Offset in elements of (t, h, 0) from the base pointer.
  int64_t offset(int64_t t, int64_t h) const {
    if (!paged()) return t * stride_token + h * stride_head;
    return int64_t(block_table[t / page_size]) * stride_page + (t % page_size) * stride_token + h * stride_head;
  }
  // q8_0: offset in scales of the scale of (t, h, 0).
  int64_t scale_offset(int64_t t, int64_t h) const { return offset(t, h) / kQ8Block; }
  // Number of tokens from t on that are contiguous in memory (to the end of t's page, or of the span).
  int64_t run_length(int64_t t) const {
    if (!paged()) return n_tokens - t;
    const int64_t in_page = page_size - t % page_size;
    return in_page < n_tokens - t ? in_page : n_tokens - t;
  }

  // Dense layout (n_tokens, n_kv_heads, head_dim) unless strides are given.
  template <class T>
  static KvView contiguous(const T* k, const T* v, int64_t n_tokens, int n_kv_heads, int head_dim,
                           int64_t stride_token = -1, int64_t stride_head = -1) {
    KvView kv;
    kv.dtype = dtype_of_v<T>;
    kv.n_tokens = n_tokens;
    kv.n_kv_heads = n_kv_heads;
    kv.head_dim = head_dim;
    kv.k = k;
    kv.v = v;
    kv.stride_head = stride_head >= 0 ? stride_head : head_dim;
    kv.stride_token = stride_token >= 0 ? stride_token : int64_t(n_kv_heads) * head_dim;
    return kv;
  }

  // Pages laid out (page, page_size, n_kv_heads, head_dim) unless strides are given.
  template <class T>
  static KvView paged_view(const T* k_pages, const T* v_pages, const int32_t* block_table, int64_t n_tokens,
                           int64_t page_size, int n_kv_heads, int head_dim, int64_t stride_page = -1,
                           int64_t stride_token = -1, int64_t stride_head = -1) {
    KvView kv = contiguous(k_pages, v_pages, n_tokens, n_kv_heads, head_dim, stride_token, stride_head);
    kv.block_table = block_table;
    kv.page_size = page_size;
    kv.stride_page = stride_page >= 0 ? stride_page : page_size * kv.stride_token;
    return kv;
  }

  // q8_0 codes and their scales, dense (n_tokens, n_kv_heads, head_dim) unless strides are given (in codes;
  // the scales' are 1/32 of them).
  static KvView contiguous_q8_0(const int8_t* k, const f16* k_scales, const int8_t* v, const f16* v_scales,
                                int64_t n_tokens, int n_kv_heads, int head_dim, int64_t stride_token = -1,
                                int64_t stride_head = -1) {
    KvView kv;
    kv.dtype = DType::q8_0;
    kv.n_tokens = n_tokens;
    kv.n_kv_heads = n_kv_heads;
    kv.head_dim = head_dim;
    kv.k = k;
    kv.v = v;
    kv.k_scales = k_scales;
    kv.v_scales = v_scales;
    kv.stride_head = stride_head >= 0 ? stride_head : head_dim;
    kv.stride_token = stride_token >= 0 ? stride_token : int64_t(n_kv_heads) * head_dim;
    return kv;
  }

  // Paged q8_0 codes (page, page_size, n_kv_heads, head_dim) and scales (page, page_size, n_kv_heads,
  // head_dim / 32) unless strides are given.
  static KvView paged_q8_0(const int8_t* k_pages, const f16* k_scale_pages, const int8_t* v_pages,
                           const f16* v_scale_pages, const int32_t* block_table, int64_t n_tokens, int64_t page_size,
                           int n_kv_heads, int head_dim, int64_t stride_page = -1, int64_t stride_token = -1,
                           int64_t stride_head = -1) {
    KvView kv = contiguous_q8_0(k_pages, k_scale_pages, v_pages, v_scale_pages, n_tokens, n_kv_heads, head_dim,
                                stride_token, stride_head);
    kv.block_table = block_table;
    kv.page_size = page_size;
    kv.stride_page = stride_page >= 0 ? stride_page : page_size * kv.stride_token;
    return kv;
  }

  // Throws an Error naming the problem; `what` names the view in the message.
  void validate(const char* what = "KV view") const {
    CASCADE_CHECK(n_tokens >= 0, what, ": n_tokens is negative (", n_tokens, ")");
    CASCADE_CHECK(n_kv_heads > 0, what, ": n_kv_heads must be positive (got ", n_kv_heads, ")");
    CASCADE_CHECK(head_dim > 0, what, ": head_dim must be positive (got ", head_dim, ")");
    CASCADE_CHECK(int(dtype) < kNumDTypes, what, ": invalid dtype");
    const bool q8 = dtype == DType::q8_0;
    CASCADE_CHECK(!q8 || head_dim % kQ8Block == 0, what, ": q8_0 K/V needs a head dim that is a multiple of ",
                  kQ8Block, " (got ", head_dim, ")");
    if (n_tokens == 0) return;
    CASCADE_CHECK(k != nullptr && v != nullptr, what, ": null K or V data with ", n_tokens, " tokens");
    CASCADE_CHECK(!q8 || (k_scales != nullptr && v_scales != nullptr), what, ": null q8_0 scales with ", n_tokens,
                  " tokens");
    CASCADE_CHECK(stride_head >= 0 && stride_token >= 0, what, ": negative stride");
    CASCADE_CHECK(!q8 || (stride_head % kQ8Block == 0 && stride_token % kQ8Block == 0 &&
                          (!paged() || stride_page % kQ8Block == 0)),
                  what, ": q8_0 strides must be multiples of ", kQ8Block, " codes (head ", stride_head, ", token ",
                  stride_token, paged() ? ", page " + std::to_string(stride_page) : std::string(), ")");
    if (paged()) {
      CASCADE_CHECK(page_size > 0, what, ": paged view with page_size ", page_size);
      CASCADE_CHECK(stride_page >= 0, what, ": negative page stride");
      const int64_t n_pages = (n_tokens + page_size - 1) / page_size;
      for (int64_t p = 0; p < n_pages; ++p)
        CASCADE_CHECK(block_table[p] >= 0, what, ": block table entry ", p, " is negative (", block_table[p], ")");
    }
  }
};

}  // namespace cascade
