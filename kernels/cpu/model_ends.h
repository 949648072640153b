// The pieces of a model around its decoder layers, ops of their own and, in one call with the
// layers, the layer stack's decode (fused_layer.cpp): the token embedding read from a
// quantized table, RoPE's rows, and the greedy pick over the logits.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace tandem {

// [R, k] float32: rows `index` [R] of a quantized matrix (quant_matmul.cpp)
at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                           int64_t bits, int64_t rows, int64_t k, const at::Tensor& index);

// cos, sin [N, 1, head_dim] for positions [N] (rotary.cpp)
std::tuple<at::Tensor, at::Tensor> rope_rows(const at::Tensor& positions,
                                             const at::Tensor& inv_freq, double scaling,
                                             int64_t head_dim);

// logits [R, V] float32 -> each row's first maximal index [R] int64, and whether it holds a
// NaN [R] bool (argmax.cpp; AVX2 builds)
std::tuple<at::Tensor, at::Tensor> argmax_rows(const at::Tensor& logits);

}  // namespace tandem
