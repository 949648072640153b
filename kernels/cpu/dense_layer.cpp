// One Llama-family or Gemma 3 decoder layer over float32 weights, for any rows of a step, in
// one call:
//
//   h = rms_norm(x) w1;  q, k, v = h Wqkv^T (+ b);  rotate q, k (RoPE; head norms if any);
//   store k, v at the rows' cache slots;  a = softmax(q K^T scale) V over each row's paged
//   context (paged_attention.h, read in place);  o = a Wo^T;  x += o, or rms_norm(o) p1;
//   h = rms_norm(x) w2;  g, u = h Wgu^T (+ b);  o = (act(g) u) Wdown^T (+ b);  x += o, or
//   rms_norm(o) p2  (act: silu or GELU-tanh; p1, p2: Gemma 3's post norms, if given)
//
// the dense twin of fused_layer.cpp: the same pieces (layer_pieces.h) around torch's own GEMM
// instead of the quantized kernel. Each projection is the one its weight format runs from
// Python (engine/models/layers.py): F.linear over a plain [out, in] weight (MKL), or oneDNN's
// packed GEMM over an opaque packed weight, its rows padded to the same count as Packed
// does, so a step composed from Python pieces (LoRA rows, tensor-parallel sums) gives the rows
// it does not touch the same bits as this call. What the call saves is the ~25 torch ops per
// layer and their Python around the four GEMMs.
#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <vector>

#include "attend_rows.h"
#include "layer_pieces.h"
#include "simd.h"

namespace tandem {
namespace {

#if TANDEM_HAVE_KERNEL
// engine.models.layers.padded_rows: the row count oneDNN's packed GEMM runs at (exact up to
// 32, above that rounded up to an eighth of the power of two below), which bounds the shapes
// it keeps state for.
int64_t padded_rows(int64_t rows) {
  if (rows <= 32) return rows;
  int64_t bits = 0;
  for (int64_t r = rows; r > 0; r >>= 1) ++bits;
  const int64_t step = int64_t{1} << (bits - 4);
  return (rows + step - 1) / step * step;
}

// y [M, out] = x W^T + b, as the weight's format computes it from Python.
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  if (!w.is_mkldnn()) return at::linear(x, w, b);  // Dense: F.linear
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<std::string_view>)>();
  const int64_t rows = x.size(0), padded = padded_rows(rows);
  const at::Tensor in = padded == rows ? x : at::constant_pad_nd(x, {0, 0, 0, padded - rows}, 0);
  const at::Tensor y = op.call(in, w, b, "none", c10::List<std::optional<at::Scalar>>(), "");
  return padded == rows ? y : y.narrow(0, 0, rows);  // (leading rows: still contiguous)
}
#endif

void dense_layer(at::Tensor x, const std::vector<at::Tensor>& weights,
                 const c10::List<std::optional<at::Tensor>>& biases, const at::Tensor& norm1,
                 const at::Tensor& norm2, double eps, const at::Tensor& cos, const at::Tensor& sin,
                 at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                 const at::Tensor& block_tables, const at::Tensor& row_tables,
                 const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, double scale,
                 int64_t window, const std::optional<at::Tensor>& q_norm,
                 const std::optional<at::Tensor>& k_norm, double head_eps, int64_t rotary_dim,
                 const std::optional<at::Tensor>& post_norm1,
                 const std::optional<at::Tensor>& post_norm2, bool gelu) {
#if TANDEM_HAVE_KERNEL
  TORCH_CHECK(weights.size() == 4 && biases.size() == 4,
              "tandem_cpu: dense_layer takes the weights and biases of qkv, o, gate_up, down");
  const Heads hd = heads_of(num_heads, num_kv_heads, cos);
  const int64_t batch = x.size(0), hidden = x.size(1);
  check_rows(x, hidden, "x");
  for (const at::Tensor* n : {&norm1, &norm2}) {
    TORCH_CHECK(n->scalar_type() == at::kFloat && n->is_contiguous() && n->numel() == hidden,
                "tandem_cpu: the norm weights must be contiguous float32 [hidden]");
  }
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == batch * hd.head_dim,
              "tandem_cpu: cos, sin must be contiguous [B, (1,) D]");
  const Rows rows =
      rows_of(per_row(slots, batch, "slots"), block_tables, row_tables, seq_lens, batch);
  const HeadPrep prep = head_prep(q_norm, k_norm, head_eps, hd.head_dim, rotary_dim);
  const LayerExtras extras = layer_extras(post_norm1, post_norm2, gelu, hidden);
  std::vector<std::optional<at::Tensor>> b(biases.begin(), biases.end());

  at::Tensor h = at::empty_like(x);  // [B, hidden]
  norm_rows(x.data_ptr<float>(), norm1.data_ptr<float>(), static_cast<float>(eps), batch, hidden,
            h.data_ptr<float>());
  at::Tensor qkv = project(h, weights[0], b[0]).contiguous();  // [B, q + 2 kv]
  check_rows(qkv, hd.cols(), "the qkv projection");
  at::Tensor attn = at::empty({batch, hd.q_size()}, x.options());  // [B, q]
  with_caches(k_cache, v_cache, num_kv_heads, hd.head_dim, [&](const auto& kc, const auto& vc) {
    rope_store_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), hd, rows,
                    kc, vc, prep);
    attend_rows(qkv.data_ptr<float>(), hd, rows, kc, vc, static_cast<float>(scale), window,
                attn.data_ptr<float>());
  });
  at::Tensor o = project(attn, weights[1], b[1]).contiguous();  // [B, hidden]
  add_rows(x.data_ptr<float>(), o.data_ptr<float>(), extras.post_attn, eps, batch, hidden);

  norm_rows(x.data_ptr<float>(), norm2.data_ptr<float>(), static_cast<float>(eps), batch, hidden,
            h.data_ptr<float>());
  at::Tensor gu = project(h, weights[2], b[2]).contiguous();  // [B, 2 inter]
  const int64_t inter = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) % 16 == 0, "tandem_cpu: gate_up must be [rows, 2 I], I a multiple of 8");
  at::Tensor act = at::empty({batch, inter}, x.options());  // [B, inter]
  gated_act_rows(gu.data_ptr<float>(), batch, inter, act.data_ptr<float>(), extras.gelu);
  o = project(act, weights[3], b[3]).contiguous();
  add_rows(x.data_ptr<float>(), o.data_ptr<float>(), extras.post_mlp, eps, batch, hidden);
#else
  TORCH_CHECK(false, "tandem_cpu: built without AVX2 and FMA");
#endif
}

}  // namespace
}  // namespace tandem

TORCH_LIBRARY_FRAGMENT(tandem_cpu, lib) {
  lib.def(
      "dense_layer(Tensor(a!) x, Tensor[] weights, Tensor?[] biases, Tensor norm1, Tensor norm2, "
      "float eps, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, "
      "Tensor block_tables, Tensor row_tables, Tensor seq_lens, int num_heads, "
      "int num_kv_heads, float scale, int window, Tensor? q_norm=None, Tensor? k_norm=None, "
      "float head_eps=0., int rotary_dim=0, Tensor? post_norm1=None, Tensor? post_norm2=None, "
      "bool gelu=False) -> ()",
      &tandem::dense_layer);
}
