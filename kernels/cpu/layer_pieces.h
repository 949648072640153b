// The row-wise pieces of a decoder layer that the C++ layers share (fused_layer.cpp over
// quantized projections, dense_layer.cpp over float32 ones): RMSNorm, RoPE with the store of
// k and v into the cache, the gated activations, the residual sums (through Gemma 3's norms of
// each half's output where given), and the checks of their arguments. Every
// piece works one row at a time in a fixed order of operations, so a row's bits depend on that
// row alone.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "kv_int8.h"
#include "paged_attention.h"
#include "simd.h"

namespace tandem {
namespace {

#if TANDEM_HAVE_KERNEL
// n a multiple of 8 (head_dim and hidden sizes are).
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  }
  return hsum(acc);
}

// out = w * (x / sqrt(mean(x^2) + eps)), as RMSNorm in float32.
void rms_norm(const float* x, const float* w, float eps, int64_t n, float* out) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 h = _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), h));
  }
}

// x's first r dims rotated in place: x' = x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]
// over those r (partial rotary: the rest pass through, as their table entries cos 1, sin 0 say).
void rope(float* x, const float* cos, const float* sin, int64_t r) {
  const int64_t half = r / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// out = gelu_tanh(gate) up, gelu_tanh(g) = g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))),
// with tanh(y) = 1 - 2 / (e^(2y) + 1). n % 8 == 0.
void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), half = _mm256_set1_ps(0.5f);
  const __m256 c = _mm256_set1_ps(0.7978845608028654f), k = _mm256_set1_ps(0.044715f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 y = _mm256_mul_ps(c, _mm256_add_ps(g, _mm256_mul_ps(k, g3)));
    const __m256 e = exp256(_mm256_mul_ps(two, y));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
    const __m256 act = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, t));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(act, _mm256_loadu_ps(up + i)));
  }
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n) {  // n % 8 == 0
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
  }
}
#endif

#if TANDEM_HAVE_KERNEL
void norm_rows(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* out) {
  for (int64_t b = 0; b < rows; ++b) rms_norm(x + b * n, w, eps, n, out + b * n);
}

// What each q and k head goes through before the store: an RMSNorm (Qwen3, Gemma 3), RoPE.
struct HeadPrep {
  const float* q = nullptr;  // [D]
  const float* k = nullptr;  // [D]
  float eps = 0.0f;
  int64_t rotary = 0;  // the rotated dims of a head (the rest pass through); 0: all
};

// q and k of every row normed per head (if norms), rotated in place (positions' cos, sin
// [rows, D]); k, v stored.
template <class KV>
void rope_store_rows(float* qkv, const float* cs, const float* sn, const Heads& hd,
                     const Rows& rows, const KV& kc, const KV& vc, const HeadPrep& prep) {
  const int64_t d = hd.head_dim;
  for (int64_t b = 0; b < rows.count; ++b) {
    float* row = qkv + b * hd.cols();
    for (int64_t head = 0; head < hd.num_heads + hd.num_kv_heads; ++head) {
      float* x = row + head * d;
      const float* w = head < hd.num_heads ? prep.q : prep.k;
      if (w != nullptr) rms_norm(x, w, prep.eps, d, x);  // (reads x before writing it)
      rope(x, cs + b * d, sn + b * d, prep.rotary > 0 ? prep.rotary : d);
    }
    const int64_t bs = kc.block_size, block = rows.slots[b] / bs, offset = rows.slots[b] % bs;
    for (int64_t g = 0; g < hd.num_kv_heads; ++g) {
      const float* k = row + hd.q_size() + g * d;
      store_kv(kc, vc, g, block, offset, k, k + hd.kv_size(), d);
    }
  }
}

template <void (*ACT)(const float*, const float*, float*, int64_t)>
void act_mul_rows(const float* gu, int64_t rows, int64_t inter, float* act) {
  for (int64_t b = 0; b < rows; ++b) ACT(gu + b * 2 * inter, gu + b * 2 * inter + inter,
                                         act + b * inter, inter);
}
#endif

// What a layer may add to the Llama form (Gemma 3): an RMSNorm of the attention's output and
// of the MLP's before each residual sum (null: none), and GELU-tanh in the MLP for SiLU.
struct LayerExtras {
  const float* post_attn = nullptr;  // [hidden]
  const float* post_mlp = nullptr;   // [hidden]
  bool gelu = false;
};

#if TANDEM_HAVE_KERNEL
// x += out, or x += rms_norm(out) post, row by row (out [rows, n] normed in place): the bits
// of the Python pieces' `x + post_norm(out)`, one float add per element either way.
void add_rows(float* x, float* out, const float* post, float eps, int64_t rows, int64_t n) {
  if (post != nullptr) norm_rows(out, post, eps, rows, n, out);  // (rms_norm reads, then writes)
  for (int64_t i = 0; i < rows * n; ++i) x[i] += out[i];
}

void gated_act_rows(const float* gu, int64_t rows, int64_t inter, float* act, bool gelu) {
  if (gelu) {
    act_mul_rows<gelu_tanh_mul>(gu, rows, inter, act);
  } else {
    act_mul_rows<silu_mul>(gu, rows, inter, act);
  }
}
#endif

LayerExtras layer_extras(const std::optional<at::Tensor>& post_attn,
                         const std::optional<at::Tensor>& post_mlp, bool gelu, int64_t hidden) {
  LayerExtras extras;
  extras.gelu = gelu;
  for (auto [t, out] : {std::pair{&post_attn, &extras.post_attn},
                        std::pair{&post_mlp, &extras.post_mlp}}) {
    if (!t->has_value()) continue;
    TORCH_CHECK((*t)->scalar_type() == at::kFloat && (*t)->is_contiguous() &&
                    (*t)->numel() == hidden,
                "tandem_cpu: the post norms must be contiguous float32 [hidden]");
    *out = (*t)->data_ptr<float>();
  }
  return extras;
}

HeadPrep head_prep(const std::optional<at::Tensor>& q_norm,
                   const std::optional<at::Tensor>& k_norm, double eps, int64_t head_dim,
                   int64_t rotary_dim) {
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "tandem_cpu: q_norm and k_norm go together");
  TORCH_CHECK(rotary_dim >= 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0,
              "tandem_cpu: rotary_dim must be even and at most head_dim, got ", rotary_dim);
  if (!q_norm.has_value()) return {nullptr, nullptr, 0.0f, rotary_dim};
  for (const at::Tensor* t : {&*q_norm, &*k_norm}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == head_dim,
                "tandem_cpu: q_norm and k_norm must be contiguous float32 [head_dim]");
  }
  return {q_norm->data_ptr<float>(), k_norm->data_ptr<float>(), static_cast<float>(eps),
          rotary_dim};
}

Heads heads_of(int64_t num_heads, int64_t num_kv_heads, const at::Tensor& cos) {
  const int64_t d = cos.size(-1);
  TORCH_CHECK(d % 8 == 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "tandem_cpu: head_dim must be a multiple of 8 and num_heads of num_kv_heads");
  return {num_heads, num_kv_heads, d};
}

void check_rows(const at::Tensor& t, int64_t cols, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous() &&
                  t.size(1) == cols,
              "tandem_cpu: ", what, " must be contiguous float32 [rows, ", cols, "], got ",
              t.sizes());
}

}  // namespace
}  // namespace tandem
