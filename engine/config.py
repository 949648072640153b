"""Engine configuration: the one home for defaults, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"  # embedded name or a local HF directory
    block_size: int = 16
    max_num_seqs: int = 128  # requests running at once
    max_num_batched_tokens: int = 1024  # token budget per step (prefill chunk size)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_memory_bytes: int | None = None  # KV budget; default: a fraction of free RAM
    kv_cache_memory_fraction: float = 0.1
    num_kv_blocks: int | None = None  # exact pool size, overrides the byte budget (tests)
    enable_prefix_caching: bool = True
    seed: int = 0  # engine generator for unseeded random sampling
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("max_model_len", "kv_cache_memory_bytes", "num_kv_blocks", "num_threads"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.9:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 0.9], got {self.kv_cache_memory_fraction}"
            )

    def kv_budget_bytes(self) -> int:
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        return int(psutil.virtual_memory().available * self.kv_cache_memory_fraction)
