"""The model shape every part of the engine reads (layers, heads, sizes); each architecture maps
an HF config to it (engine.models.architectures)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    hidden_act: str
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3)
    attn_scale: float | None = None  # the scores' scale; None: head_dim ** -0.5
    layer_windows: tuple[int, ...] | None = None  # each layer's window (0: all); None: all alike
    embed_scale: float | None = None  # the embedding's rows multiplied by it (Gemma: sqrt(hidden))
    rotary_dim: int | None = None  # the rotated dims of a head (partial rotary); None: head_dim

    def window_of(self, layer: int) -> int | None:
        if self.layer_windows is None:
            return self.sliding_window
        return self.layer_windows[layer] or None

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct attention windows of the layers (None: the whole context)."""
        return tuple(sorted({self.window_of(i) for i in range(self.num_layers)}, key=str))

    def kv_bytes_per_block(self, block_size: int, element_bytes: int = 4) -> int:
        """One KV block's bytes: K and V of every layer and KV head, block_size positions."""
        return self.num_layers * 2 * self.num_kv_heads * block_size * self.head_dim * element_bytes


def common_fields(hf) -> dict:
    """The fields every architecture reads the same way from an HF config."""
    return dict(
        model_type=hf.model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )
