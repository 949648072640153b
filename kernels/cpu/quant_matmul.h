// Quantized weights as the CPU kernels read them (layout: quant_matmul.cpp's header comment).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace tandem {

// How a matrix holds its scales d and offsets m (both alike).
enum class Params : int {
  kFloat,  // [rows / 16, kp / 32, 16] float32
  kHalf,   // the same, float16
  kCentered,  // float16 d as kHalf; m = -2^(bits - 1) d (Q4_0, Q5_0, Q8_0) formed, not stored
  kSuper,  // K-quants: [rows / 16, kp / 256, 160] uint8, per tile and super-block the 16 rows'
           // float16 d (or -dmin), then 8 groups x 16 rows of 6-bit sub-scales (or mins)
  kQ6,     // Q6_K: [rows / 16, kp / 256, 288] uint8, the 16 rows' float16 d, then 16 sub-blocks
           // of 16 inputs x 16 rows of int8 scales; w = d sc (q - 32), m unused
};

struct QuantizedMatrix {
  const uint8_t* codes;  // [rows / 16 tiles, kp / 32 groups, 256 (4 bits) or 512 (8 bits)]
  const void* d;         // scales, laid out as `params` says
  const void* m;         // offsets, as d
  const float* bias;     // [rows] or null
  int64_t rows;
  int64_t kp;  // inputs, padded to a multiple of 32
  int bits;
  Params params;
};

// Checks the tensors' shapes and types and views them (no copy).
QuantizedMatrix matrix(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                       int64_t bits, int64_t rows, const std::optional<at::Tensor>& bias);

// y [num_rows, ldy] = x [num_rows, k] W^T (+ bias); x's rows quantized per 32 to int8.
void linear(const QuantizedMatrix& w, const float* x, int64_t num_rows, int64_t k, float* y,
            int64_t ldy);

// A projection whose output rows come in segments of their own formats (a fused q/k/v with
// a v of another GGUF type): segment i's outputs are y's columns after segment i - 1's.
struct Projection {
  std::vector<QuantizedMatrix> parts;
  int64_t rows = 0;  // all segments'
};

// Segments [first, first + count) of weights (codes, d, m each), bits and rows; the bias
// [projection rows] split among them.
Projection projection(const std::vector<at::Tensor>& weights, at::IntArrayRef bits,
                      at::IntArrayRef rows, int64_t first, int64_t count,
                      const std::optional<at::Tensor>& bias);

// As linear above over every segment, x quantized once.
void linear(const Projection& w, const float* x, int64_t num_rows, int64_t k, float* y,
            int64_t ldy);

}  // namespace tandem
