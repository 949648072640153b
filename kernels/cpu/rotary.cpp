// RoPE's cos and sin for a step's rows, computed from their positions: no table of every
// position (Gemma 3 270M's two tables over its 32k context held 134 MB, half its file). Every
// entry is a function of its (position, column) alone, scalar cosf / sinf of the float32 angle
// p f (the product torch's table forms), so a row's values never depend on the rows beside it
// or on how a loop over them was split.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "model_ends.h"

namespace tandem {

// cos, sin [N, 1, D] for positions [N] and inv_freq [R / 2], as engine/models/layers.py's
// RotaryTables: columns j and j + R / 2 (j < R / 2) at angle p inv_freq[j], times scaling;
// columns from R on pass through (cos 1, sin 0).
std::tuple<at::Tensor, at::Tensor> rope_rows(const at::Tensor& positions,
                                             const at::Tensor& inv_freq, double scaling,
                                             int64_t head_dim) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.is_contiguous(),
              "tandem_cpu: positions must be contiguous int64 [N]");
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat && inv_freq.dim() == 1 &&
                  inv_freq.is_contiguous() && 2 * inv_freq.numel() <= head_dim,
              "tandem_cpu: inv_freq must be contiguous float32 [R / 2], R <= head_dim");
  const int64_t n = positions.numel(), half = inv_freq.numel();
  at::Tensor cos = at::empty({n, 1, head_dim}, inv_freq.options());
  at::Tensor sin = at::empty_like(cos);
  const int64_t* p = positions.data_ptr<int64_t>();
  const float* f = inv_freq.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  for (int64_t r = 0; r < n; ++r) {
    float* c = cos.data_ptr<float>() + r * head_dim;
    float* s = sin.data_ptr<float>() + r * head_dim;
    for (int64_t j = 0; j < half; ++j) {
      const float angle = static_cast<float>(p[r]) * f[j];
      c[j] = c[j + half] = std::cos(angle) * scale;
      s[j] = s[j + half] = std::sin(angle) * scale;
    }
    for (int64_t j = 2 * half; j < head_dim; ++j) {
      c[j] = 1.0f;
      s[j] = 0.0f;
    }
  }
  return {cos, sin};
}

}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem_cpu, lib) {
  lib.def(
      "rope_rows(Tensor positions, Tensor inv_freq, float scaling, int head_dim) -> "
      "(Tensor, Tensor)",
      &tandem::rope_rows);
}
