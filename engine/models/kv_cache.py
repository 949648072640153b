"""A model's KV cache storage (EngineConfig.kv_cache_dtype): floats in the model's dtype (the
exact default), or int8 codes with a float32 scale per 32 values of each (kv head, slot) row
for a model whose layers run on the C++ kernels (kernels/kv_int8.py; kernels/cpu/kv_int8.h
reads it in place).

Quality rule for "int8" (tests/engine/test_kv_int8.py holds it on SmolLM2's GGUF over 1024
tokens of real text, teacher-forced through one prefill and through decode steps, against the
same model with a float32 cache): top-1 agreement >= 95%, perplexity within 1% and the mean
|log-prob difference| of the text's tokens at most 0.1; the same cache with its codes cut to
4 bits fails it. (Any perturbation of these models' activations moves some int8
activation codes of the quantized projections across a rounding boundary, so even exact float
K with int8 V alone gave SmolLM2 ~96.5% top-1 and ~0.06 mean |difference|: that is the floor.)
Qwen2.5-Coder-0.5B misses it (perplexity x1.018, top-1 94.0%): its keys' outlier dims need
smaller groups (K in groups of 8 passed in a float simulation); the test marks it xfail.
The bytes per token fall from 8 D to 2 (D + D / 8) per layer and kv head: 3.56x the tokens in
the same memory. A bfloat16 cache beside float32 weights is not built yet.
"""

from __future__ import annotations

import torch

from engine.config import KV_DTYPES as KV_CACHE_DTYPES
from engine.models.quantized import QuantizedLinear as Quantized
from kernels.kv_int8 import row_bytes

_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kv_cache_format(kv_cache_dtype: str, model, strict: bool = True) -> torch.dtype:
    """The element type of the model's KV cache: its own dtype ("auto", or that dtype named) or
    int8 (a model whose layers run on the C++ kernels: `model.fused_layers`). strict=False (a
    draft model): a model that cannot hold int8 keeps its dtype instead of raising."""
    dtype = model.norm.weight.dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype == "int8":
        if model.fused_layers and isinstance(model.layers[0].self_attn.qkv_proj.format, Quantized):
            return torch.int8
        if not strict:
            return dtype
        raise ValueError(
            "kv_cache_dtype='int8' is read by the C++ CPU layers over quantized weights only (a "
            "GGUF model on CPU in float32, as the embedded models run by default); this model "
            "attends in torch or Triton, or has dense weights (the exact reference, whose cache "
            "stays float)"
        )
    if _FLOATS[kv_cache_dtype] != dtype:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} differs from the model's dtype ({dtype}); a float "
            "cache in another type than the model's is not supported yet"
        )
    return dtype


def row_size(head_dim: int, fmt: torch.dtype) -> int:
    """The last dimension of the cache tensor: D elements, or D codes and a scale's bytes."""
    return row_bytes(head_dim) if fmt == torch.int8 else head_dim


def kv_bytes_per_block(cfg, block_size: int, fmt: torch.dtype) -> int:
    """One block's bytes for a model (cfg: engine.models.config.ModelConfig): K and V of every
    layer and kv head, block_size positions, scales included."""
    element = torch.empty((), dtype=fmt).element_size()
    row = row_size(cfg.head_dim, fmt) * element
    return cfg.num_layers * 2 * cfg.num_kv_heads * block_size * row


def allocate(cfg, num_blocks: int, block_size: int, fmt: torch.dtype, device) -> torch.Tensor:
    """[num_layers, 2 (K, V), Hkv, num_blocks, block_size, D (int8: its row_bytes)], zeroed."""
    shape = (cfg.num_layers, 2, cfg.num_kv_heads, num_blocks, block_size)
    return torch.zeros(*shape, row_size(cfg.head_dim, fmt), dtype=fmt, device=device)
