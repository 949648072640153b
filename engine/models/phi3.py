"""Phi-3 and Phi-4-mini (model_type "phi3"): the pre-norm Llama block, with Q/K/V and gate/up
already fused in the checkpoint, one sliding window over every layer where the config sets
one, LongRoPE (two sets of frequency factors, chosen by the engine's context: see
engine.models.layers.rope_parameters) and partial rotary (Phi-4-mini rotates 3/4 of each
head; the rest passes through).

GGUF files of Phi-3 are not read yet (llama.cpp stores the LongRoPE factors as tensors).
"""

from __future__ import annotations

from engine.models import llama
from engine.models.architectures import Architecture, Checkpoint, WeightMap
from engine.models.config import ModelConfig, common_fields


def phi3_config(hf) -> ModelConfig:
    if hf.hidden_act != "silu":
        raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported (only 'silu')")
    head_dim = hf.hidden_size // hf.num_attention_heads
    rotary = int(head_dim * (hf.rope_parameters or {}).get("partial_rotary_factor", 1.0))
    return ModelConfig(
        **common_fields(hf),
        qkv_bias=False,
        mlp_bias=False,
        sliding_window=getattr(hf, "sliding_window", None),
        hidden_act="silu",
        rotary_dim=rotary if rotary < head_dim else None,
    )


def hf_weights(cfg: ModelConfig, ckpt: Checkpoint) -> WeightMap:
    yield "embed_tokens", ckpt.take("embed_tokens.weight")
    yield "norm", ckpt.take("norm.weight")
    yield "lm_head", None if cfg.tie_word_embeddings else ckpt.take("lm_head.weight")
    ckpt.drop("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        yield p + "self_attn.qkv_proj", ckpt.take(p + "self_attn.qkv_proj.weight"), None
        yield p + "self_attn.o_proj", ckpt.take(p + "self_attn.o_proj.weight"), None
        yield p + "mlp.gate_up_proj", ckpt.take(p + "mlp.gate_up_proj.weight"), None
        yield p + "mlp.down_proj", ckpt.take(p + "mlp.down_proj.weight"), None
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield p + norm, ckpt.take(p + norm + ".weight")


def gguf_weights(cfg: ModelConfig, w) -> WeightMap:
    raise ValueError("Phi-3 GGUF files are not supported yet; use the HF checkpoint")


ARCHITECTURES = {"phi3": Architecture(phi3_config, llama.build, hf_weights, gguf_weights)}
