// One Llama-family decoder layer for rows of short queries (decode: one token per request;
// speculative verification: the last token and the drafts), in one call:
//
//   h = rms_norm(x) w1;  q, k, v = h Wqkv^T (+ b);  rotate q, k (RoPE, rotate-half);
//   store k, v at the tokens' cache slots;  a = softmax(q K^T scale) V over each row's paged
//   context up to its own position (sliding window if any);  x += a Wo^T;
//   h = rms_norm(x) w2;  g, u = h Wgu^T;  x += (silu(g) u) Wdown^T
//
// the same math as engine/models/llama.py's DecoderLayer over engine/attention.py, with the four
// projections on the quantized kernel (quant_matmul.cpp). At batch 1 a layer is ~25 small torch
// ops in Python (~5 us each): here it is one call, and attention reads the cache in place
// instead of gathering a padded copy. Float32 throughout. Every row goes through the same
// instructions whatever else is in the call, so a verification row computes exactly what the
// same token's decode step would: speculation over quantized weights keeps plain decoding's
// tokens.
//
// Cache layout (kernels/reference.py): [Hkv, num_blocks, block_size, D] for K and V; a slot is
// block * block_size + offset; block tables are padded with the null block 0.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "quant_matmul.h"
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

inline void axpy(float a, const float* x, float* y, int64_t n) {  // y += a x
  const __m256 va = _mm256_set1_ps(a);
  for (int64_t i = 0; i < n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
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

// x [D] rotated in place: x' = x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1].
void rope(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// In place: s[0:n] = exp(s - max) / sum, returned unnormalized; the sum is the result.
float softmax_unnormalized(float* s, int64_t n) {
  float top = -INFINITY;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, s[i]);
  const __m256 vtop = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), vtop));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float total = hsum(acc);
  if (i < n) {  // the tail through a padded buffer (same exp as the body)
    alignas(32) float buf[8] = {0};
    for (int64_t j = i; j < n; ++j) buf[j - i] = s[j];
    const __m256 e = exp256(_mm256_sub_ps(_mm256_load_ps(buf), vtop));
    _mm256_store_ps(buf, e);
    for (int64_t j = i; j < n; ++j) {
      s[j] = buf[j - i];
      total += s[j];
    }
  }
  return total;
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

struct Cache {
  float* data;
  int64_t head_stride, block_stride, slot_stride, block_size;
  float* at(int64_t head, int64_t block, int64_t offset) const {
    return data + head * head_stride + block * block_stride + offset * slot_stride;
  }
};

Cache view(at::Tensor& cache, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.dim() == 4 &&
                  cache.size(0) == num_kv_heads && cache.size(3) == head_dim &&
                  cache.stride(3) == 1,
              "tandem_cpu: caches must be float32 [Hkv, num_blocks, block_size, D]");
  return {cache.data_ptr<float>(), cache.stride(0), cache.stride(1), cache.stride(2),
          cache.size(2)};
}

void decode_layer(at::Tensor x, const std::vector<at::Tensor>& weights, at::IntArrayRef bits,
                  const std::optional<at::Tensor>& qkv_bias, const at::Tensor& norm1,
                  const at::Tensor& norm2, double eps, const at::Tensor& cos,
                  const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                  const at::Tensor& slots, const at::Tensor& block_tables,
                  const at::Tensor& row_tables, const at::Tensor& seq_lens,
                  int64_t num_heads, int64_t num_kv_heads,
                  double scale, int64_t window) {
#if TANDEM_HAVE_KERNEL
  TORCH_CHECK(weights.size() == 12 && bits.size() == 4,
              "tandem_cpu: weights are (codes, d, m) for qkv, o, gate_up, down");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "tandem_cpu: x must be contiguous float32 [B, hidden]");
  const int64_t batch = x.size(0), hidden = x.size(1);
  const int64_t head_dim = cos.size(-1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const QuantizedMatrix qkv_w = matrix(weights[0], weights[1], weights[2], bits[0], qkv_bias);
  const QuantizedMatrix o_w = matrix(weights[3], weights[4], weights[5], bits[1], {});
  const QuantizedMatrix gu_w = matrix(weights[6], weights[7], weights[8], bits[2], {});
  const QuantizedMatrix down_w = matrix(weights[9], weights[10], weights[11], bits[3], {});
  const int64_t inter = gu_w.rows / 2;
  TORCH_CHECK(qkv_w.rows == q_size + 2 * kv_size && o_w.rows == hidden &&
                  down_w.rows == hidden && hidden % 8 == 0 && inter % 8 == 0 &&
                  head_dim % 8 == 0 && num_heads % num_kv_heads == 0,
              "tandem_cpu: projection shapes do not match the heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == batch * head_dim,
              "tandem_cpu: cos, sin must be contiguous [B, (1,) D]");
  for (const at::Tensor* t : {&slots, &seq_lens, &row_tables}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == batch,
                "tandem_cpu: slots, row_tables, seq_lens must be contiguous int64 [rows]");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.dim() == 2,
              "tandem_cpu: block_tables must be contiguous int64 [requests, max_blocks]");
  const Cache kc = view(k_cache, num_kv_heads, head_dim);
  const Cache vc = view(v_cache, num_kv_heads, head_dim);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* table_of = row_tables.data_ptr<int64_t>();
  const int64_t num_tables = block_tables.size(0);
  const int64_t table_width = block_tables.size(1);
  float* xs = x.data_ptr<float>();

  thread_local std::vector<float> buf;
  const int64_t qkv_cols = qkv_w.rows;
  buf.resize(batch * (hidden + qkv_cols + q_size + 3 * inter + hidden));
  float* h = buf.data();                 // [B, hidden]
  float* qkv = h + batch * hidden;       // [B, q + 2 kv]
  float* attn = qkv + batch * qkv_cols;  // [B, q]
  float* gu = attn + batch * q_size;     // [B, 2 inter]
  float* act = gu + batch * 2 * inter;   // [B, inter]
  float* out = act + batch * inter;      // [B, hidden]

  // --- attention block ---
  for (int64_t b = 0; b < batch; ++b) {
    rms_norm(xs + b * hidden, norm1.data_ptr<float>(), eps, hidden, h + b * hidden);
  }
  linear(qkv_w, h, batch, hidden, qkv, qkv_cols);
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    float* row = qkv + b * qkv_cols;
    for (int64_t head = 0; head < num_heads + num_kv_heads; ++head) {
      rope(row + head * head_dim, cs + b * head_dim, sn + b * head_dim, head_dim);
    }
    const int64_t block = slot[b] / kc.block_size, offset = slot[b] % kc.block_size;
    for (int64_t g = 0; g < num_kv_heads; ++g) {
      std::copy_n(row + q_size + g * head_dim, head_dim, kc.at(g, block, offset));
      std::copy_n(row + q_size + kv_size + g * head_dim, head_dim, vc.at(g, block, offset));
    }
  }
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores, totals(group);  // per worker, reused across its tasks
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / num_kv_heads, g = task % num_kv_heads;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      TORCH_CHECK(len >= 1 && (len - 1) / kc.block_size < table_width &&
                      table_of[b] >= 0 && table_of[b] < num_tables,
                  "tandem_cpu: a row's context is beyond its block table");
      const int64_t* table = tables + table_of[b] * table_width;
      scores.assign(group * n, 0.0f);
      const float* q = qkv + b * qkv_cols + g * group * head_dim;  // the group's query heads
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const float* key = kc.at(g, table[pos / kc.block_size], pos % kc.block_size);
        for (int64_t r = 0; r < group; ++r) {
          scores[r * n + t] = dot(q + r * head_dim, key, head_dim) * static_cast<float>(scale);
        }
      }
      float* o = attn + b * q_size + g * group * head_dim;
      std::fill_n(o, group * head_dim, 0.0f);
      for (int64_t r = 0; r < group; ++r) totals[r] = softmax_unnormalized(&scores[r * n], n);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const float* value = vc.at(g, table[pos / vc.block_size], pos % vc.block_size);
        for (int64_t r = 0; r < group; ++r) axpy(scores[r * n + t], value, o + r * head_dim, head_dim);
      }
      for (int64_t r = 0; r < group; ++r) {
        const float inv = 1.0f / totals[r];
        for (int64_t i = 0; i < head_dim; ++i) o[r * head_dim + i] *= inv;
      }
    }
  });
  linear(o_w, attn, batch, q_size, out, hidden);
  for (int64_t i = 0; i < batch * hidden; ++i) xs[i] += out[i];

  // --- MLP block ---
  for (int64_t b = 0; b < batch; ++b) {
    rms_norm(xs + b * hidden, norm2.data_ptr<float>(), eps, hidden, h + b * hidden);
  }
  linear(gu_w, h, batch, hidden, gu, 2 * inter);
  for (int64_t b = 0; b < batch; ++b) {
    silu_mul(gu + b * 2 * inter, gu + b * 2 * inter + inter, act + b * inter, inter);
  }
  linear(down_w, act, batch, inter, out, hidden);
  for (int64_t i = 0; i < batch * hidden; ++i) xs[i] += out[i];
#else
  TORCH_CHECK(false, "tandem_cpu: built without AVX2 and FMA");
#endif
}

}  // namespace
}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem_cpu, lib) {
  lib.def(
      "decode_layer(Tensor(a!) x, Tensor[] weights, int[] bits, Tensor? qkv_bias, Tensor norm1, "
      "Tensor norm2, float eps, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
      "Tensor slots, Tensor block_tables, Tensor row_tables, Tensor seq_lens, int num_heads, "
      "int num_kv_heads, "
      "float scale, int window) -> ()",
      &tandem::decode_layer);
}
