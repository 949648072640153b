"""Qwen3: the Llama decoder with an RMSNorm over each query and key head before RoPE, no QKV
bias by default, and a head size of its own (not hidden / heads)."""

from __future__ import annotations

from engine.models import llama
from engine.models.architectures import Architecture
from engine.models.config import ModelConfig, common_fields


def qwen3_config(hf) -> ModelConfig:
    if hf.hidden_act != "silu":
        raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported (only 'silu')")
    if getattr(hf, "use_sliding_window", False) or hf.attention_bias:
        raise ValueError("Qwen3 with use_sliding_window or attention_bias is not supported yet")
    return ModelConfig(
        **common_fields(hf),
        qkv_bias=bool(hf.attention_bias),
        mlp_bias=False,
        sliding_window=None,
        hidden_act="silu",
        qk_norm=True,
    )


ARCHITECTURES = {
    "qwen3": Architecture(qwen3_config, llama.build, llama.hf_weights, llama.gguf_weights)
}
