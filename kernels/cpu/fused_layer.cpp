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
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "attend_rows.h"
#include "kv_int8.h"
#include "layer_pieces.h"
#include "model_ends.h"
#include "quant_matmul.h"
#include "simd.h"

namespace tandem {
namespace {

// weights: (codes, d, m) per segment, bits and out_features per segment, parts: how many
// segments each of qkv, o, gate_up and down has (quant_matmul.h's Projection).
void fused_layer(at::Tensor x, const std::vector<at::Tensor>& weights, at::IntArrayRef bits,
                 at::IntArrayRef out_features, at::IntArrayRef parts,
                 const std::optional<at::Tensor>& qkv_bias,
                 const at::Tensor& norm1, const at::Tensor& norm2, double eps,
                 const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                 at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                 const at::Tensor& row_tables, const at::Tensor& seq_lens, int64_t num_heads,
                 int64_t num_kv_heads, double scale, int64_t window,
                 const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                 double head_eps, int64_t rotary_dim, const std::optional<at::Tensor>& post_norm1,
                 const std::optional<at::Tensor>& post_norm2, bool gelu) {
#if TANDEM_HAVE_KERNEL
  TORCH_CHECK(parts.size() == 4,
              "tandem_cpu: weights are segments of qkv, o, gate_up and down, `parts` of each");
  const Heads hd = heads_of(num_heads, num_kv_heads, cos);
  const int64_t batch = x.size(0), hidden = x.size(1);
  check_rows(x, hidden, "x");
  std::vector<Projection> w;
  int64_t first = 0;
  for (int i = 0; i < 4; ++i) {
    w.push_back(projection(weights, bits, out_features, first, parts[i],
                           i == 0 ? qkv_bias : std::nullopt));
    first += parts[i];
  }
  TORCH_CHECK(first == static_cast<int64_t>(bits.size()),
              "tandem_cpu: ", bits.size(), " segments for parts summing to ", first);
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

// ---- a model's decoder layers in one call ---------------------------------------------------
// A decode step at batch 1 on a small model is ~30 layer calls of ~0.3 ms each: from Python
// each costs ~50 us of module attributes and argument parsing, serial with the second thread.
// The stack holds every layer's operands (the same tensors the modules hold: a storage moved
// later, as into huge pages, is seen through them) and runs the layers in order with the same
// fused_layer, so its rows get the bits of the layer-by-layer calls.
struct LayerStack : torch::CustomClassHolder {
  struct Layer {
    std::vector<at::Tensor> weights;  // (codes, d, m) per segment of qkv, o, gate_up, down
    std::vector<int64_t> bits, out_features, parts;  // per segment; segments per projection
    std::optional<at::Tensor> qkv_bias, q_norm, k_norm, post_norm1, post_norm2;
    at::Tensor norm1, norm2;
    int64_t window, rope;  // rope: which of the step's (cos, sin) tables
  };
  // The model around the layers, for `decode` (set_ends): the token embedding and the LM head
  // as quantized matrices (codes, d, m; a tied pair reads the same tiles), Gemma's embedding
  // scale (a float32 scalar tensor, or empty), each RoPE table's inv_freq, scaling and head
  // dim, the final norm.
  struct Ends {
    std::vector<at::Tensor> embed, head;
    int64_t embed_bits, head_bits, vocab_rows, head_rows, vocab_size;
    at::Tensor embed_scale, norm;
    double norm_eps;
    std::vector<at::Tensor> inv_freq;
    std::vector<double> rope_scaling;
    std::vector<int64_t> rope_dim;
  };
  std::vector<Layer> layers;
  std::optional<Ends> ends;
  double eps, scale, head_eps;
  int64_t num_heads, num_kv_heads, rotary_dim;
  bool gelu;

  // Per layer l: parts[4 l, 4 l + 4) segments for its projections, n_l in all; its weights
  // the next 3 n_l of `weights`, its bits and out_features the next n_l; tensors[7 l, 7 l + 7)
  // = norm1, norm2, qkv_bias, q_norm, k_norm, post_norm1, post_norm2 (an empty tensor where a
  // layer has none), windows[l], ropes[l].
  LayerStack(std::vector<at::Tensor> weights, std::vector<int64_t> bits,
             std::vector<int64_t> out_features, std::vector<int64_t> parts,
             std::vector<at::Tensor> tensors, std::vector<int64_t> windows,
             std::vector<int64_t> ropes, double eps, int64_t num_heads, int64_t num_kv_heads,
             double scale, double head_eps, int64_t rotary_dim, bool gelu)
      : eps(eps), scale(scale), head_eps(head_eps), num_heads(num_heads),
        num_kv_heads(num_kv_heads), rotary_dim(rotary_dim), gelu(gelu) {
    const size_t n = windows.size();
    TORCH_CHECK(parts.size() == 4 * n && tensors.size() == 7 * n && ropes.size() == n &&
                    bits.size() == out_features.size() && weights.size() == 3 * bits.size(),
                "tandem_cpu: LayerStack takes 4 segment counts and 7 tensors a layer, 3 weights, "
                "bits and rows a segment");
    auto some = [](const at::Tensor& t) {
      return t.numel() == 0 ? std::nullopt : std::optional<at::Tensor>(t);
    };
    size_t seg = 0;
    for (size_t l = 0; l < n; ++l) {
      const at::Tensor* t = &tensors[7 * l];
      const std::vector<int64_t> counts(parts.begin() + 4 * l, parts.begin() + 4 * l + 4);
      size_t count = 0;
      for (int64_t c : counts) count += c;
      TORCH_CHECK(seg + count <= bits.size(), "tandem_cpu: fewer segments than parts say");
      layers.push_back(Layer{{weights.begin() + 3 * seg, weights.begin() + 3 * (seg + count)},
                             {bits.begin() + seg, bits.begin() + seg + count},
                             {out_features.begin() + seg, out_features.begin() + seg + count},
                             counts, some(t[2]), some(t[3]), some(t[4]), some(t[5]), some(t[6]),
                             t[0], t[1], windows[l], ropes[l]});
      seg += count;
    }
    TORCH_CHECK(seg == bits.size(), "tandem_cpu: more segments than parts say");
  }

  // x [B, hidden] updated in place; cos[r], sin[r] [B, 1, D] for each kind of RoPE; k_caches,
  // v_caches [layers, Hkv, num_blocks, block_size, D or int8 row bytes] (layer l's select).
  void forward(at::Tensor x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
               at::Tensor k_caches, at::Tensor v_caches, at::Tensor slots,
               at::Tensor block_tables, at::Tensor row_tables, at::Tensor seq_lens) {
    TORCH_CHECK(k_caches.size(0) == static_cast<int64_t>(layers.size()) &&
                    v_caches.size(0) == k_caches.size(0),
                "tandem_cpu: one cache per layer");
    for (size_t l = 0; l < layers.size(); ++l) {
      const Layer& L = layers[l];
      TORCH_CHECK(L.rope >= 0 && L.rope < static_cast<int64_t>(cos.size()) && sin.size() == cos.size(),
                  "tandem_cpu: a layer's RoPE table is missing");
      fused_layer(x, L.weights, L.bits, L.out_features, L.parts, L.qkv_bias, L.norm1, L.norm2,
                  eps, cos[L.rope], sin[L.rope], k_caches.select(0, l), v_caches.select(0, l),
                  slots, block_tables, row_tables, seq_lens, num_heads, num_kv_heads, scale, L.window,
                  L.q_norm, L.k_norm, head_eps, rotary_dim, L.post_norm1, L.post_norm2, gelu);
    }
  }

  void set_ends(std::vector<at::Tensor> embed, int64_t embed_bits, int64_t vocab_rows,
                at::Tensor embed_scale, std::vector<at::Tensor> inv_freq,
                std::vector<double> rope_scaling, std::vector<int64_t> rope_dim,
                at::Tensor norm, double norm_eps, std::vector<at::Tensor> head,
                int64_t head_bits, int64_t head_rows, int64_t vocab_size) {
    TORCH_CHECK(embed.size() == 3 && head.size() == 3 && inv_freq.size() == rope_scaling.size() &&
                    inv_freq.size() == rope_dim.size() && vocab_size <= head_rows,
                "tandem_cpu: the ends are (codes, d, m) twice and one inv_freq, scaling and "
                "head dim per RoPE table");
    ends = Ends{embed, head, embed_bits, head_bits, vocab_rows, head_rows, vocab_size,
                embed_scale, norm, norm_eps, inv_freq, rope_scaling, rope_dim};
  }

  // Greedy decode of B requests' single rows for S steps, from what the runner holds as
  // lists: ids, positions [B] (each row's last token and its position), slots [B * S] (row b's
  // step s at b S + s), tables [B * W] (row b's blocks, padded with the null block). Row b
  // attends its own table up to its position + s at step s. The lists are viewed, not copied
  // (a tensor built from Python costs tens of microseconds a step, most of a token's host time
  // at batch 1 after a pass over the weights has left the caches cold).
  std::tuple<at::Tensor, at::Tensor> decode(std::vector<int64_t> ids,
                                            std::vector<int64_t> positions,
                                            at::Tensor k_caches, at::Tensor v_caches,
                                            std::vector<int64_t> slots,
                                            std::vector<int64_t> tables) {
    const int64_t batch = static_cast<int64_t>(ids.size());
    TORCH_CHECK(batch > 0 && static_cast<int64_t>(positions.size()) == batch &&
                    slots.size() % batch == 0 && !slots.empty() && tables.size() % batch == 0 &&
                    !tables.empty(),
                "tandem_cpu: decode takes ids, positions [B], slots [B * S], tables [B * W]");
    const int64_t steps = slots.size() / batch, width = tables.size() / batch;
    const auto longs = at::TensorOptions().dtype(at::kLong);
    auto view = [&](std::vector<int64_t>& v, at::IntArrayRef shape) {
      return at::from_blob(v.data(), shape, longs);  // lives for this call
    };
    at::Tensor pos = view(positions, {batch});
    return decode_rows(view(ids, {batch}), pos, k_caches, v_caches, view(slots, {batch, steps}),
                       view(tables, {batch, width}), at::arange(batch, longs), pos.add(1));
  }

  // Greedy decode of B rows for S steps in one call: step s embeds ids (the given ones, then
  // each row's pick of step s - 1), runs the layers at positions + s, slots[:, s] and
  // context seq_lens + s, the final norm, the LM head and each row's first maximal logit over
  // the vocabulary: the ops a step of single rows runs from Python (embedding, rope_rows,
  // forward, rms_norm, linear_out, argmax_rows), in order, so the same bits. A row whose
  // logits hold a NaN is flagged (its later steps mean nothing). Returns tokens, is_nan [B, S].
  std::tuple<at::Tensor, at::Tensor> decode_rows(at::Tensor ids, at::Tensor positions,
                                                 at::Tensor k_caches, at::Tensor v_caches,
                                                 at::Tensor slots, at::Tensor block_tables,
                                                 at::Tensor row_tables, at::Tensor seq_lens) {
#if TANDEM_HAVE_KERNEL
    TORCH_CHECK(ends.has_value(), "tandem_cpu: the stack has no ends to decode with");
    const Ends& E = *ends;
    const int64_t batch = ids.numel(), steps = slots.size(1);
    TORCH_CHECK(slots.dim() == 2 && slots.size(0) == batch && positions.numel() == batch &&
                    seq_lens.numel() == batch && row_tables.numel() == batch,
                "tandem_cpu: decode takes ids, positions, row_tables, seq_lens [B], slots [B, S]");
    const QuantizedMatrix head = matrix(E.head[0], E.head[1], E.head[2], E.head_bits,
                                        E.head_rows, {});
    at::Tensor tokens = at::empty({batch, steps}, ids.options().dtype(at::kLong));
    at::Tensor is_nan = at::empty({batch, steps}, ids.options().dtype(at::kBool));
    at::Tensor logits = at::empty({batch, E.head_rows}, E.norm.options());
    at::Tensor id = ids.to(at::kLong).contiguous();
    for (int64_t s = 0; s < steps; ++s) {
      at::Tensor x = dequantize_rows(E.embed[0], E.embed[1], E.embed[2], E.embed_bits,
                                     E.vocab_rows, E.norm.numel(), id);  // [B, hidden]
      if (E.embed_scale.defined() && E.embed_scale.numel() == 1) x.mul_(E.embed_scale);
      at::Tensor pos = positions.add(s).contiguous();
      std::vector<at::Tensor> cos, sin;
      for (size_t r = 0; r < E.inv_freq.size(); ++r) {
        auto [c, sn] = rope_rows(pos, E.inv_freq[r], E.rope_scaling[r], E.rope_dim[r]);
        cos.push_back(c);
        sin.push_back(sn);
      }
      forward(x, cos, sin, k_caches, v_caches, slots.select(1, s).contiguous(), block_tables,
              row_tables, seq_lens.add(s));
      at::Tensor h = at::empty_like(x);
      norm_rows(x.data_ptr<float>(), E.norm.data_ptr<float>(), static_cast<float>(E.norm_eps),
                batch, x.size(1), h.data_ptr<float>());
      linear(head, h.data_ptr<float>(), batch, h.size(1), logits.data_ptr<float>(),
             E.head_rows);
      auto [pick, nan] = argmax_rows(logits.narrow(1, 0, E.vocab_size));
      tokens.select(1, s).copy_(pick);
      is_nan.select(1, s).copy_(nan);
      id = pick;
    }
    return {tokens, is_nan};
#else
    TORCH_CHECK(false, "tandem_cpu: built without AVX2 and FMA");
#endif
  }
};

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
      "fused_layer(Tensor(a!) x, Tensor[] weights, int[] bits, int[] out_features, int[] parts, "
      "Tensor? qkv_bias, Tensor norm1, Tensor norm2, float eps, Tensor cos, Tensor sin, "
      "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor block_tables, "
      "Tensor row_tables, Tensor seq_lens, int num_heads, int num_kv_heads, float scale, "
      "int window, Tensor? q_norm=None, Tensor? k_norm=None, float head_eps=0., "
      "int rotary_dim=0, Tensor? post_norm1=None, Tensor? post_norm2=None, bool gelu=False) -> ()",
      &tandem::fused_layer);
  lib.class_<tandem::LayerStack>("LayerStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                       double, int64_t, int64_t, double, double, int64_t, bool>())
      .def("forward", &tandem::LayerStack::forward)
      .def("set_ends", &tandem::LayerStack::set_ends)
      .def("decode", &tandem::LayerStack::decode);
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
