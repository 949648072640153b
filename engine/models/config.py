"""The model shape every part of the engine reads (layers, heads, sizes), from an HF config."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2"}


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

    def kv_bytes_per_block(self, block_size: int, element_bytes: int = 4) -> int:
        """One KV block's bytes: K and V of every layer and KV head, block_size positions."""
        return self.num_layers * 2 * self.num_kv_heads * block_size * self.head_dim * element_bytes

    @classmethod
    def from_hf(cls, hf) -> ModelConfig:
        if hf.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model_type {hf.model_type!r} is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported (only 'silu')")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        window = getattr(hf, "sliding_window", None)
        if hf.model_type == "qwen2" and not getattr(hf, "use_sliding_window", False):
            window = None
        return cls(
            model_type=hf.model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_window=window,
            hidden_act="silu",
        )
