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
