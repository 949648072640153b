"""The Llama family (Llama, Mistral, Qwen2): config mapping and weight maps, which Qwen3
reuses (engine/models/qwen3.py: a norm over each query and key head).

Q/K/V and gate/up are fused into one projection each (fewer, larger GEMMs); the weight maps
stack the checkpoint's rows. Qwen2 differs only by a bias on the QKV projection and an untied
LM head, Mistral by an optional sliding window. The decoder layer is the shared pre-norm block
(engine.models.layers.DecoderLayer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.models.architectures import Architecture, Checkpoint, WeightMap
from engine.models.causal_lm import CausalLM
from engine.models.config import ModelConfig, common_fields
from engine.models.layers import DecoderLayer, RotaryTables
from engine.models.parallel import Parallel
from engine.models.quantized import QuantizedWeight

if TYPE_CHECKING:
    from engine.models.gguf_loader import GGUFWeights


def llama_config(hf) -> ModelConfig:
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported (only 'silu')")
    window = getattr(hf, "sliding_window", None)
    if hf.model_type == "qwen2" and not getattr(hf, "use_sliding_window", False):
        window = None
    return ModelConfig(
        **common_fields(hf),
        qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        sliding_window=window,
        hidden_act="silu",
    )


def build(cfg: ModelConfig, hf, context: int, parallel: Parallel) -> CausalLM:
    layers = [DecoderLayer(cfg, i, parallel) for i in range(cfg.num_layers)]
    return CausalLM(cfg, layers, RotaryTables.of(hf, cfg.head_dim, context), parallel)


def hf_weights(cfg: ModelConfig, ckpt: Checkpoint) -> WeightMap:
    yield "embed_tokens", ckpt.take("embed_tokens.weight")
    yield "norm", ckpt.take("norm.weight")
    yield "lm_head", None if cfg.tie_word_embeddings else ckpt.take("lm_head.weight")
    ckpt.drop("lm_head.weight")  # (a tied checkpoint may store it anyway)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        att, mlp = p + "self_attn.", p + "mlp."
        qkv_bias = ckpt.cat([att + f"{n}_proj.bias" for n in "qkv"]) if cfg.qkv_bias else None
        yield att + "qkv_proj", ckpt.cat([att + f"{n}_proj.weight" for n in "qkv"]), qkv_bias
        yield att + "o_proj", ckpt.take(att + "o_proj.weight"), None
        gate_up = [mlp + "gate_proj", mlp + "up_proj"]
        bias = ckpt.cat([n + ".bias" for n in gate_up]) if cfg.mlp_bias else None
        yield mlp + "gate_up_proj", ckpt.cat([n + ".weight" for n in gate_up]), bias
        bias = ckpt.take(mlp + "down_proj.bias") if cfg.mlp_bias else None
        yield mlp + "down_proj", ckpt.take(mlp + "down_proj.weight"), bias
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield p + norm, ckpt.take(p + norm + ".weight")
        if cfg.qk_norm:
            yield att + "q_norm", ckpt.take(att + "q_norm.weight")
            yield att + "k_norm", ckpt.take(att + "k_norm.weight")


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: its converter interleaves each head's
    two RoPE halves (row (h, i, j) for half i, pair j goes to (h, j, i))."""
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)


def gguf_weights(cfg: ModelConfig, w: GGUFWeights) -> WeightMap:
    """The GGUF's tensors under our names, projections in their blocks (engine.models.
    gguf_blocks), fused and in HF's row order; norms and biases float32."""
    if cfg.mlp_bias:
        raise ValueError("GGUF models with MLP biases are not supported")
    embed = w.quantized("token_embd.weight")
    yield "embed_tokens", embed
    yield "norm", w.dense("output_norm.weight")
    yield "lm_head", w.quantized("output.weight") if w.has("output.weight") else embed
    q_order = k_order = None
    if cfg.model_type in ("llama", "mistral"):  # Q/K rows permuted by llama.cpp's converter
        q_order = unpermute_rows(cfg.num_heads * cfg.head_dim, cfg.num_heads)
        k_order = unpermute_rows(cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads)
    for i in range(cfg.num_layers):
        p, ours = f"blk.{i}.", f"layers.{i}."
        yield ours + "input_layernorm", w.dense(p + "attn_norm.weight")
        yield ours + "post_attention_layernorm", w.dense(p + "ffn_norm.weight")
        qkv = [
            w.quantized(p + "attn_q.weight", q_order),
            w.quantized(p + "attn_k.weight", k_order),
            w.quantized(p + "attn_v.weight"),
        ]
        bias = torch.cat([w.dense(p + f"attn_{n}.bias") for n in "qkv"]) if cfg.qkv_bias else None
        yield ours + "self_attn.qkv_proj", QuantizedWeight.cat_rows(qkv), bias
        yield ours + "self_attn.o_proj", w.quantized(p + "attn_output.weight"), None
        gate_up = [w.quantized(p + "ffn_gate.weight"), w.quantized(p + "ffn_up.weight")]
        yield ours + "mlp.gate_up_proj", QuantizedWeight.cat_rows(gate_up), None
        yield ours + "mlp.down_proj", w.quantized(p + "ffn_down.weight"), None
        if cfg.qk_norm:
            yield ours + "self_attn.q_norm", w.dense(p + "attn_q_norm.weight")
            yield ours + "self_attn.k_norm", w.dense(p + "attn_k_norm.weight")


LLAMA = Architecture(llama_config, build, hf_weights, gguf_weights)
ARCHITECTURES = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA}
