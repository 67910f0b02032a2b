// A view of the keys and values of one KV span (a segment of the cascade tree): n_tokens tokens,
// n_kv_heads heads, head_dim values each, for K and V alike. The view does not own memory.
//
// Contiguous storage (token-major, any strides, in ELEMENTS):
//   K(t, h, i) = k[t * stride_token + h * stride_head + i]          (same for V with v)
// Paged storage (a block table of fixed-size pages, as in vLLM and FlashInfer):
//   page = block_table[t / page_size], slot = t % page_size
//   K(t, h, i) = k[page * stride_page + slot * stride_token + h * stride_head + i]
// The innermost dimension (i < head_dim) is always dense.
#pragma once

#include <cstdint>
#include <vector>

#include "cascade/dtype.hpp"
#include "cascade/error.hpp"

namespace cascade {

struct KvView {
  DType dtype = DType::f32;
  int64_t n_tokens = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  const void* k = nullptr;  // element type = dtype
  const void* v = nullptr;
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

  // Throws an Error naming the problem; `what` names the view in the message.
  void validate(const char* what = "KV view") const {
    CASCADE_CHECK(n_tokens >= 0, what, ": n_tokens is negative (", n_tokens, ")");
    CASCADE_CHECK(n_kv_heads > 0, what, ": n_kv_heads must be positive (got ", n_kv_heads, ")");
    CASCADE_CHECK(head_dim > 0, what, ": head_dim must be positive (got ", head_dim, ")");
    CASCADE_CHECK(dtype == DType::f32 || dtype == DType::f16 || dtype == DType::bf16, what, ": invalid dtype");
    if (n_tokens == 0) return;
    CASCADE_CHECK(k != nullptr && v != nullptr, what, ": null K or V data with ", n_tokens, " tokens");
    CASCADE_CHECK(stride_head >= 0 && stride_token >= 0, what, ": negative stride");
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
