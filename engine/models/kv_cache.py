"""A model's KV cache storage (EngineConfig.kv_cache_dtype): floats in the model's dtype (the
exact default), or int8 codes with float32 scales, a scale per 8 values of each (kv head, slot)
key row and per 32 of each value row, for a model whose layers run on the C++ kernels
(kernels/kv_int8.py; kernels/cpu/kv_int8.h reads it in place).

Quality rule for "int8" (tests/engine/test_kv_int8.py holds it on SmolLM2's GGUF and on
Qwen2.5-Coder-0.5B's over 1024 tokens of real text, teacher-forced through one prefill and
through decode steps, against the same model with a float32 cache): top-1 agreement >= 95%,
perplexity within 1% and the mean |log-prob difference| of the text's tokens at most 0.1; the
same cache with its codes cut to 4 bits fails it. (Any perturbation of these models'
activations moves some int8 activation codes of the quantized projections across a rounding
boundary, so even exact float K with int8 V alone gave SmolLM2 ~96.5% top-1 and ~0.06 mean
|difference|: that is the floor.) The keys' groups are narrower because rotated keys carry a
few outlier dims: with K in groups of 32, Qwen2.5-Coder-0.5B missed the rule (perplexity
x1.018, top-1 94.0%); in groups of 8 it meets it (x1.001, 96.8%; groups of 16 passed with half
the top-1 margin: bench/RESULTS.md). The bytes per token fall from 8 D to
D + D / 2 (K) + D + D / 8 (V) per layer and kv head: 3.05x the tokens in the same memory.
K and V rows differ in width, so an int8 cache is two tensors (Int8Caches).

"bfloat16" beside float32 weights (the same C++ layers; elsewhere a float cache is in the
model's own dtype): each value rounded to nearest even as it is stored and widened exactly as
it is read, 2x the tokens in the same memory; the same quality rule holds it
(tests/engine/test_kv_int8.py).
"""

from __future__ import annotations

import torch

from engine.config import KV_DTYPES as KV_CACHE_DTYPES
from engine.models import huge_pages
from engine.models.quantized import QuantizedLinear as Quantized
from kernels.kv_int8 import row_bytes

_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kv_cache_format(kv_cache_dtype: str, model, strict: bool = True) -> torch.dtype:
    """The element type of the model's KV cache: its own dtype ("auto", or that dtype named),
    or int8 or bfloat16 beside float32 weights (a model whose layers run on the C++ kernels:
    `model.fused_layers`). strict=False (a draft model): a model that cannot hold the type
    asked for keeps its dtype instead of raising."""
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
    fmt = _FLOATS[kv_cache_dtype]
    if fmt == dtype:
        return dtype
    if fmt == torch.bfloat16 and dtype == torch.float32 and model.fused_layers:
        return fmt  # rounded as stored, widened as read (kernels/cpu/paged_attention.h)
    if not strict:
        return dtype
    raise ValueError(
        f"kv_cache_dtype={kv_cache_dtype!r} differs from the model's dtype ({dtype}); a cache "
        "in another float type is read by the C++ CPU layers only, bfloat16 beside float32 "
        "weights (GGUF or dense float32 on CPU, SiLU MLPs)"
    )


def row_size(head_dim: int, fmt: torch.dtype, is_key: bool) -> int:
    """The last dimension of a K or V cache tensor: D elements, or D codes and their scales'
    bytes (int8: K's and V's differ)."""
    return row_bytes(head_dim, is_key) if fmt == torch.int8 else head_dim


def kv_bytes_per_block(cfg, block_size: int, fmt: torch.dtype) -> int:
    """One block's bytes for a model (cfg: engine.models.config.ModelConfig): K and V of every
    layer and kv head, block_size positions, scales included."""
    element = torch.empty((), dtype=fmt).element_size()
    rows = sum(row_size(cfg.head_dim, fmt, is_key) for is_key in (True, False)) * element
    return cfg.num_layers * cfg.num_kv_heads * block_size * rows


class Int8Caches:
    """An int8 cache: K [num_layers, Hkv, num_blocks, block_size, row_bytes(D, True)] and V
    [..., row_bytes(D, False)], two tensors as their rows differ in width. caches[i] is layer
    i's (K, V), as a float cache's [2, Hkv, ...] is indexed."""

    dtype = torch.int8

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def __len__(self) -> int:
        return self.k.shape[0]

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def num_blocks(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in (self.k, self.v):
            t[:, :, dst] = t[:, :, src]


def allocate(cfg, num_blocks: int, block_size: int, fmt: torch.dtype, device):
    """Float: a tensor [num_layers, 2 (K, V), Hkv, num_blocks, block_size, D]; int8:
    Int8Caches. Zeroed; on CPU in huge pages (engine.models.huge_pages: attention streams it)."""
    shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size)
    if fmt == torch.int8:
        k, v = (
            huge_pages.zeros(*shape, row_bytes(cfg.head_dim, is_key), dtype=fmt, device=device)
            for is_key in (True, False)
        )
        return Int8Caches(k, v)
    return huge_pages.zeros(shape[0], 2, *shape[1:], cfg.head_dim, dtype=fmt, device=device)


def copy_blocks(caches, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Blocks src[i] copied to dst[i], K and V of every layer (a float tensor or Int8Caches)."""
    if isinstance(caches, Int8Caches):
        caches.copy_blocks(src, dst)
    else:
        caches[:, :, :, dst] = caches[:, :, :, src]
