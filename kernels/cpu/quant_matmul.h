// Quantized weights as the CPU kernels read them (layout: quant_matmul.cpp's header comment).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace tandem {

struct QuantizedMatrix {
  const uint8_t* codes;  // [rows / 16 tiles, kp / 32 groups, 256 (4 bits) or 512 (8 bits)]
  const void* d;         // [rows / 16, kp / 32, 16] float32, or float16 where `half`
  const void* m;         // [rows / 16, kp / 32, 16], as d
  const float* bias;     // [rows] or null
  int64_t rows;
  int64_t kp;  // inputs, padded to a multiple of 32
  int bits;
  bool half;
};

// Checks the tensors' shapes and types and views them (no copy).
QuantizedMatrix matrix(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                       int64_t bits, int64_t rows, const std::optional<at::Tensor>& bias);

// y [num_rows, ldy] = x [num_rows, k] W^T (+ bias); x's rows quantized per 32 to int8.
void linear(const QuantizedMatrix& w, const float* x, int64_t num_rows, int64_t k, float* y,
            int64_t ldy);

}  // namespace tandem
