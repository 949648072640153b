"""Gemma 3 (text): a norm before and after both attention and MLP, RMSNorms that scale by
(1 + w), an RMSNorm over each query and key head, embedding rows scaled by sqrt(hidden),
GELU's tanh approximation in a gated MLP, the scores scaled by query_pre_attn_scalar ** -0.5,
and layers of two kinds: sliding ones (a window, RoPE base 10k) and every sixth a full one (the
whole context, RoPE base 1M).

The (1 + w) is folded into the norms' weights as they load (in float32, where HF computes it),
so every norm is the shared RMSNorm. A layer runs as one C++ call where its projections'
formats have one (layers.layer_call: the quantized kernel's tiles or CPU float32 weights), the
post norms and GELU-tanh inside it; the embedding's sqrt(hidden) scale stays in CausalLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention import AttentionMetadata, RowAttention
from engine.models.architectures import Architecture, Checkpoint, WeightMap
from engine.models.causal_lm import CausalLM
from engine.models.config import ModelConfig, common_fields
from engine.models.layers import DecoderLayer, RMSNorm, RotaryTables
from engine.models.parallel import Parallel

if TYPE_CHECKING:
    from engine.models.gguf_loader import GGUFWeights
    from lora.batch import LoRABatch

NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def gemma3_config(hf) -> ModelConfig:
    if hf.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {hf.hidden_activation!r} is not supported")
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(hf, name, None) is not None:
            raise ValueError(f"Gemma 3 with {name} is not supported yet")
    if getattr(hf, "use_bidirectional_attention", False) or hf.attention_bias:
        raise ValueError("Gemma 3 with bidirectional attention or attention_bias is not supported")
    windows = tuple(hf.sliding_window if t == "sliding_attention" else 0 for t in hf.layer_types)
    return ModelConfig(
        **common_fields(hf),
        qkv_bias=False,
        mlp_bias=False,
        sliding_window=hf.sliding_window,
        hidden_act="gelu_tanh",
        qk_norm=True,
        attn_scale=hf.query_pre_attn_scalar**-0.5,
        layer_windows=windows,
        embed_scale=hf.hidden_size**0.5,
    )


class Gemma3DecoderLayer(DecoderLayer):
    """DecoderLayer's projections and one C++ call, with Gemma's four norms: its
    post_attention_layernorm norms the attention's output (Llama's names the MLP's input)."""

    def __init__(self, cfg: ModelConfig, index: int, parallel: Parallel):
        super().__init__(cfg, index, parallel)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = "local" if self.self_attn.window else "global"

    def norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm, RMSNorm]:
        return (
            self.input_layernorm,
            self.pre_feedforward_layernorm,
            self.post_attention_layernorm,
            self.post_feedforward_layernorm,
        )

    def forward(
        self,
        x: torch.Tensor,  # [N, hidden]
        cos: torch.Tensor,  # [N, 1, D] of this layer's kind of RoPE
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, Hkv, num_blocks, block_size, D] (int8: a (K, V) pair)
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        if self.one_call(meta, lora):
            return self._fused(x, cos, sin, kv_cache, meta)
        rows = isinstance(meta, RowAttention)  # the C++ pieces' numerics
        h = self.self_attn(self.input_layernorm(x, rows), cos, sin, kv_cache, meta, lora)
        x = x + self.post_attention_layernorm(h, rows)
        h = self.mlp(self.pre_feedforward_layernorm(x, rows), rows, lora)
        return x + self.post_feedforward_layernorm(h, rows)


def build(cfg: ModelConfig, hf, context: int, parallel: Parallel) -> CausalLM:
    layers = [Gemma3DecoderLayer(cfg, i, parallel) for i in range(cfg.num_layers)]
    rotary = {
        "global": RotaryTables.of(hf, cfg.head_dim, context, "full_attention"),
        "local": RotaryTables.of(hf, cfg.head_dim, context, "sliding_attention"),
    }
    return CausalLM(cfg, layers, rotary, parallel)


def hf_weights(cfg: ModelConfig, ckpt: Checkpoint) -> WeightMap:
    """HF's norms keep w and compute (1 + w); ours keep 1 + w."""

    def norm(name: str) -> torch.Tensor:
        return 1.0 + ckpt.take(name).float()

    yield "embed_tokens", ckpt.take("embed_tokens.weight")
    yield "norm", norm("norm.weight")
    yield "lm_head", None if cfg.tie_word_embeddings else ckpt.take("lm_head.weight")
    ckpt.drop("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        att, mlp = p + "self_attn.", p + "mlp."
        yield att + "qkv_proj", ckpt.cat([att + f"{n}_proj.weight" for n in "qkv"]), None
        yield att + "o_proj", ckpt.take(att + "o_proj.weight"), None
        yield att + "q_norm", norm(att + "q_norm.weight")
        yield att + "k_norm", norm(att + "k_norm.weight")
        gate_up = ckpt.cat([mlp + "gate_proj.weight", mlp + "up_proj.weight"])
        yield mlp + "gate_up_proj", gate_up, None
        yield mlp + "down_proj", ckpt.take(mlp + "down_proj.weight"), None
        for name in NORMS:
            yield p + name, norm(p + name + ".weight")


GGUF_NORMS = {  # llama.cpp's converter stores Gemma's norms as 1 + w already
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_weights(cfg: ModelConfig, w: GGUFWeights) -> WeightMap:
    from engine.models.quantized import QuantizedWeight

    embed = w.quantized("token_embd.weight")
    yield "embed_tokens", embed
    yield "norm", w.dense("output_norm.weight")
    yield "lm_head", w.quantized("output.weight") if w.has("output.weight") else embed
    for i in range(cfg.num_layers):
        p, ours = f"blk.{i}.", f"layers.{i}."
        qkv = [w.quantized(p + f"attn_{n}.weight") for n in "qkv"]
        yield ours + "self_attn.qkv_proj", QuantizedWeight.cat_rows(qkv), None
        yield ours + "self_attn.o_proj", w.quantized(p + "attn_output.weight"), None
        yield ours + "self_attn.q_norm", w.dense(p + "attn_q_norm.weight")
        yield ours + "self_attn.k_norm", w.dense(p + "attn_k_norm.weight")
        gate_up = [w.quantized(p + "ffn_gate.weight"), w.quantized(p + "ffn_up.weight")]
        yield ours + "mlp.gate_up_proj", QuantizedWeight.cat_rows(gate_up), None
        yield ours + "mlp.down_proj", w.quantized(p + "ffn_down.weight"), None
        for name, theirs in GGUF_NORMS.items():
            yield ours + name, w.dense(p + theirs + ".weight")


ARCHITECTURES = {"gemma3_text": Architecture(gemma3_config, build, hf_weights, gguf_weights)}
