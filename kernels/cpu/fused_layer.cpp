// One Llama-family or Gemma 3 decoder layer over any rows (decode tokens, verification rows,
// prefill chunks), in one call:
//
//   h = rms_norm(x) w1;  q, k, v = h Wqkv^T (+ b);  norm q, k per head (if norms);  rotate
//   q, k (RoPE, rotate-half);  store k, v at the tokens' cache slots;  a = softmax(q K^T scale)
//   V over each row's paged context up to its own position (sliding window if any);
//   o = a Wo^T;  x += o, or x += rms_norm(o) p1 (Gemma 3's post norms, if given);
//   h = rms_norm(x) w2;  g, u = h Wgu^T;  o = (act(g) u) Wdown^T;  x += o, or rms_norm(o) p2
//
// act: silu, or GELU's tanh approximation (gelu). The same math as engine/models/layers.py's
// DecoderLayer (and gemma3.py's), with the four projections on the quantized kernel
// (quant_matmul.cpp). Float32 throughout (the KV cache may be int8). Every row goes through
// the same instructions whatever else is in the call, and attends its own context one row at a
// time, so a row's numbers depend only on its request's tokens: a prompt cached or not,
// chunked one way or another, recomputed after preemption, or a verification row in place of
// the same token's decode step, all give the same bits. The pieces are ops of their own too
// (rms_norm, rope_store, attend, silu_mul, gelu_tanh_mul): the Python layer composes them
// around LoRA and tensor-parallel sums with the same results for every row those do not touch.
//
// The cache and the attention over it: paged_attention.h (float32 caches) and kv_int8.h (int8
// codes with a scale per 32 values); every piece that touches the cache takes either.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "attend_rows.h"
#include "kv_int8.h"
#include "layer_pieces.h"
#include "quant_matmul.h"
#include "simd.h"

namespace tandem {
namespace {

void fused_layer(at::Tensor x, const std::vector<at::Tensor>& weights, at::IntArrayRef bits,
                 at::IntArrayRef out_features, const std::optional<at::Tensor>& qkv_bias,
                 const at::Tensor& norm1, const at::Tensor& norm2, double eps,
                 const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                 at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                 const at::Tensor& row_tables, const at::Tensor& seq_lens, int64_t num_heads,
                 int64_t num_kv_heads, double scale, int64_t window,
                 const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                 double head_eps, int64_t rotary_dim, const std::optional<at::Tensor>& post_norm1,
                 const std::optional<at::Tensor>& post_norm2, bool gelu) {
#if TANDEM_HAVE_KERNEL
  TORCH_CHECK(weights.size() == 12 && bits.size() == 4 && out_features.size() == 4,
              "tandem_cpu: weights are (codes, d, m) for qkv, o, gate_up, down");
  const Heads hd = heads_of(num_heads, num_kv_heads, cos);
  const int64_t batch = x.size(0), hidden = x.size(1);
  check_rows(x, hidden, "x");
  std::vector<QuantizedMatrix> w;
  for (int i = 0; i < 4; ++i) {
    w.push_back(matrix(weights[3 * i], weights[3 * i + 1], weights[3 * i + 2], bits[i],
                       out_features[i], i == 0 ? qkv_bias : std::nullopt));
  }
  const int64_t inter = w[2].rows / 2;
  TORCH_CHECK(w[0].rows == hd.cols() && w[1].rows == hidden && w[3].rows == hidden &&
                  hidden % 8 == 0 && inter % 8 == 0,
              "tandem_cpu: projection shapes do not match the heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == batch * hd.head_dim,
              "tandem_cpu: cos, sin must be contiguous [B, (1,) D]");
  const Rows rows =
      rows_of(per_row(slots, batch, "slots"), block_tables, row_tables, seq_lens, batch);
  const LayerExtras extras = layer_extras(post_norm1, post_norm2, gelu, hidden);
  float* xs = x.data_ptr<float>();

  thread_local std::vector<float> buf;
  buf.resize(batch * (hidden + hd.cols() + hd.q_size() + 3 * inter + hidden));
  float* h = buf.data();                  // [B, hidden]
  float* qkv = h + batch * hidden;        // [B, q + 2 kv]
  float* attn = qkv + batch * hd.cols();  // [B, q]
  float* gu = attn + batch * hd.q_size(); // [B, 2 inter]
  float* act = gu + batch * 2 * inter;    // [B, inter]
  float* out = act + batch * inter;       // [B, hidden]

  norm_rows(xs, norm1.data_ptr<float>(), eps, batch, hidden, h);
  linear(w[0], h, batch, hidden, qkv, hd.cols());
  const HeadPrep prep = head_prep(q_norm, k_norm, head_eps, hd.head_dim, rotary_dim);
  with_caches(k_cache, v_cache, num_kv_heads, hd.head_dim, [&](const auto& kc, const auto& vc) {
    rope_store_rows(qkv, cos.data_ptr<float>(), sin.data_ptr<float>(), hd, rows, kc, vc, prep);
    attend_rows(qkv, hd, rows, kc, vc, static_cast<float>(scale), window, attn);
  });
  linear(w[1], attn, batch, hd.q_size(), out, hidden);
  add_rows(xs, out, extras.post_attn, eps, batch, hidden);

  norm_rows(xs, norm2.data_ptr<float>(), eps, batch, hidden, h);
  linear(w[2], h, batch, hidden, gu, 2 * inter);
  gated_act_rows(gu, batch, inter, act, extras.gelu);
  linear(w[3], act, batch, inter, out, hidden);
  add_rows(xs, out, extras.post_mlp, eps, batch, hidden);
#else
  TORCH_CHECK(false, "tandem_cpu: built without AVX2 and FMA");
#endif
}

// ---- the pieces, for the Python layer around LoRA and tensor-parallel sums ----------------
#if TANDEM_HAVE_KERNEL
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w.numel(), "x");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() % 8 == 0,
              "tandem_cpu: the norm weight must be contiguous float32, a multiple of 8");
  at::Tensor out = at::empty_like(x);
  norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), static_cast<float>(eps), x.size(0),
            x.size(1), out.data_ptr<float>());
  return out;
}

void rope_store_op(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                   int64_t num_heads, int64_t num_kv_heads,
                   const std::optional<at::Tensor>& q_norm,
                   const std::optional<at::Tensor>& k_norm, double head_eps,
                   int64_t rotary_dim) {
  const Heads hd = heads_of(num_heads, num_kv_heads, cos);
  check_rows(qkv, hd.cols(), "qkv");
  const int64_t batch = qkv.size(0);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == batch * hd.head_dim,
              "tandem_cpu: cos, sin must be contiguous [B, (1,) D]");
  const Rows rows{batch, per_row(slots, batch, "slots"), nullptr, nullptr, nullptr, 0, 0};
  const HeadPrep prep = head_prep(q_norm, k_norm, head_eps, hd.head_dim, rotary_dim);
  with_caches(k_cache, v_cache, num_kv_heads, hd.head_dim, [&](const auto& kc, const auto& vc) {
    rope_store_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), hd,
                    rows, kc, vc, prep);
  });
}

at::Tensor attend_op(const at::Tensor& qkv, at::Tensor k_cache, at::Tensor v_cache,
                     const at::Tensor& block_tables,
                     const at::Tensor& row_tables, const at::Tensor& seq_lens,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
                     int64_t window) {
  TORCH_CHECK(head_dim % 8 == 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "tandem_cpu: head_dim must be a multiple of 8 and num_heads of num_kv_heads");
  const Heads hd{num_heads, num_kv_heads, head_dim};
  check_rows(qkv, hd.cols(), "qkv");
  const Rows rows = rows_of(nullptr, block_tables, row_tables, seq_lens, qkv.size(0));
  at::Tensor attn = at::empty({qkv.size(0), hd.q_size()}, qkv.options());
  with_caches(k_cache, v_cache, num_kv_heads, head_dim, [&](const auto& kc, const auto& vc) {
    attend_rows(qkv.data_ptr<float>(), hd, rows, kc, vc, static_cast<float>(scale), window,
                attn.data_ptr<float>());
  });
  return attn;
}

template <void (*ACT)(const float*, const float*, float*, int64_t)>
at::Tensor act_mul_op(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 16 == 0, "tandem_cpu: gate_up must be [rows, 2 I], I a multiple of 8");
  check_rows(gu, gu.size(1), "gate_up");
  const int64_t inter = gu.size(1) / 2;
  at::Tensor act = at::empty({gu.size(0), inter}, gu.options());
  act_mul_rows<ACT>(gu.data_ptr<float>(), gu.size(0), inter, act.data_ptr<float>());
  return act;
}
#endif

}  // namespace
}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem_cpu, lib) {
  lib.def(
      "fused_layer(Tensor(a!) x, Tensor[] weights, int[] bits, int[] out_features, "
      "Tensor? qkv_bias, Tensor norm1, Tensor norm2, float eps, Tensor cos, Tensor sin, "
      "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor block_tables, "
      "Tensor row_tables, Tensor seq_lens, int num_heads, int num_kv_heads, float scale, "
      "int window, Tensor? q_norm=None, Tensor? k_norm=None, float head_eps=0., "
      "int rotary_dim=0, Tensor? post_norm1=None, Tensor? post_norm2=None, bool gelu=False) -> ()",
      &tandem::fused_layer);
#if TANDEM_HAVE_KERNEL
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &tandem::rms_norm_op);
  lib.def(
      "rope_store(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slots, int num_heads, int num_kv_heads, Tensor? q_norm=None, "
      "Tensor? k_norm=None, float head_eps=0., int rotary_dim=0) -> ()",
      &tandem::rope_store_op);
  lib.def(
      "attend(Tensor qkv, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor row_tables, Tensor seq_lens, int num_heads, int num_kv_heads, int head_dim, "
      "float scale, int window) -> Tensor",
      &tandem::attend_op);
  lib.def("silu_mul(Tensor gate_up) -> Tensor", &tandem::act_mul_op<tandem::silu_mul>);
  lib.def("gelu_tanh_mul(Tensor gate_up) -> Tensor", &tandem::act_mul_op<tandem::gelu_tanh_mul>);
#endif
}
