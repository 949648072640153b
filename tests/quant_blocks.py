"""Random GGUF quantized blocks for tests (any bytes are a valid block)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

# Byte offsets of each block's float16 header fields (scale, and min where the type has one).
HEADERS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [-2],
    T.Q3_K: [-2],
    T.Q2_K: [-4, -2],
}


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Any bytes are a valid block; only the float16 headers get sane magnitudes."""
    rng = np.random.default_rng(seed)
    values_per_block, bytes_per_block = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // values_per_block, bytes_per_block), np.uint8)
    for offset in HEADERS[qtype]:
        at = offset % bytes_per_block
        header = rng.uniform(-0.05, 0.05, blocks.shape[:2]).astype(np.float16)
        blocks[..., at : at + 2] = header[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def requantize_layer(layer, widths: str | int) -> None:
    """A tandem-kernel decoder layer's projections requantized from their values: every one
    at `widths` bits, or "segments": mixed widths within projections as Q4_K_M files mix their
    types (q, k at 4 bits beside v at 8; gate at 4 beside up at 6). Re-fuses the layer."""
    import torch

    from engine.models.layers import projections
    from engine.models.quantized import QuantizedLinear, QuantizedWeight

    attn, mlp = layer.self_attn, layer.mlp
    kv = attn.num_kv_heads * attn.head_dim
    for linear, name in zip(projections(attn, mlp), ("qkv", "o", "gate_up", "down"), strict=True):
        f = linear.format
        rows = torch.arange(f.out_features)
        w = torch.ops.tandem_cpu.dequantize_rows(
            f.codes, f.scales, f.offsets, f.bits, f.out_features, f.in_features, rows
        )
        n = f.out_features
        parts = [(n, widths)]
        if widths == "segments":
            parts = {"qkv": [(n - kv, 4), (kv, 8)], "gate_up": [(n // 2, 4), (n // 2, 6)]}
            parts = parts.get(name, [(n, 4)])
        chunks = w.split([rows for rows, _ in parts])
        weight = QuantizedWeight.cat_rows(
            [QuantizedWeight.quantize(c, b) for c, (_, b) in zip(chunks, parts, strict=True)]
        )
        linear.format = QuantizedLinear(weight, f.bias)
    assert layer.fuse()
