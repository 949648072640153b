// The KV caches as the C++ layers (fused_layer.cpp, paged_attention.h) see them: views of a
// layer's float32, bfloat16 or int8 (kv_int8.h) K and V caches, laid out [Hkv, num_blocks,
// block_size, D] (kernels/reference.py), and where each row of a call finds its keys: its
// request's block table and its context length.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include "kv_int8.h"

namespace tandem {
namespace {

using BF16 = c10::BFloat16;

// A float cache of elements T: float or BF16.
template <class T>
struct Cache {
  T* data;
  int64_t head_stride, block_stride, slot_stride, block_size;
  T* at(int64_t head, int64_t block, int64_t offset) const {
    return data + head * head_stride + block * block_stride + offset * slot_stride;
  }
};

template <class T>
Cache<T> view(at::Tensor& cache, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(cache.scalar_type() == c10::CppTypeToScalarType<T>::value && cache.dim() == 4 &&
                  cache.size(0) == num_kv_heads && cache.size(3) == head_dim &&
                  cache.stride(3) == 1,
              "tandem_cpu: caches must be float32 or bfloat16 (both alike) [Hkv, num_blocks, "
              "block_size, D]");
  return {cache.data_ptr<T>(), cache.stride(0), cache.stride(1), cache.stride(2), cache.size(2)};
}

// f(k view, v view) over float32, bfloat16 or int8 caches (kv_int8.h), as the tensors are.
template <class F>
void with_caches(at::Tensor& k_cache, at::Tensor& v_cache, int64_t num_kv_heads,
                 int64_t head_dim, F&& f) {
  if (k_cache.scalar_type() == at::kChar) {
    f(int8_view(k_cache, num_kv_heads, head_dim, true),
      int8_view(v_cache, num_kv_heads, head_dim, false));
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    f(view<BF16>(k_cache, num_kv_heads, head_dim), view<BF16>(v_cache, num_kv_heads, head_dim));
  } else {
    f(view<float>(k_cache, num_kv_heads, head_dim), view<float>(v_cache, num_kv_heads, head_dim));
  }
}

// Where each row's keys are: its request's block table and its context length.
struct Rows {
  int64_t count;
  const int64_t* slots;     // [rows] cache slot of the row's own token
  const int64_t* lens;      // [rows] context length, the row's own token included
  const int64_t* table_of;  // [rows] the row's request: a row of tables
  const int64_t* tables;    // [requests, width]
  int64_t num_tables, width;
};

const int64_t* per_row(const at::Tensor& t, int64_t count, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == count,
              "tandem_cpu: ", what, " must be contiguous int64 [", count, "]");
  return t.data_ptr<int64_t>();
}

// slots: the rows' own cache slots where they are stored, else null.
Rows rows_of(const int64_t* slots, const at::Tensor& block_tables, const at::Tensor& row_tables,
             const at::Tensor& seq_lens, int64_t count) {
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.dim() == 2,
              "tandem_cpu: block_tables must be contiguous int64 [requests, max_blocks]");
  return {count,
          slots,
          per_row(seq_lens, count, "seq_lens"),
          per_row(row_tables, count, "row_tables"),
          block_tables.data_ptr<int64_t>(),
          block_tables.size(0),
          block_tables.size(1)};
}

struct Heads {
  int64_t num_heads, num_kv_heads, head_dim;
  int64_t q_size() const { return num_heads * head_dim; }
  int64_t kv_size() const { return num_kv_heads * head_dim; }
  int64_t cols() const { return q_size() + 2 * kv_size(); }  // a qkv row
};

}  // namespace
}  // namespace tandem
