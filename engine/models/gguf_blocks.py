"""GGUF quantized blocks -> QuantizedWeight (engine/models/quantized.py), without a float detour
where the block's codes fit.

Each decoder reads a tensor's raw rows ([N, bytes per row] uint8, as gguf.GGUFReader maps them)
and returns integer codes q with a scale and offset per 32 values, w = scale q + offset, the
block's own numbers: Q4_0, Q4_1, Q4_K (4-bit), Q5_0, Q5_1, Q5_K (5-bit) and Q8_0 (8-bit) are
held exactly (float32 scales and offsets; torch's int4 kernel, where it is the backend,
rounds them to bf16). Every other type gguf can dequantize (Q6_K, whose
scales cover 16 values, Q2_K, Q3_K, IQ*, F16, ...) is requantized to 8 bits per 32 values: an
error of at most a 510th of each group's range, below the source format's own step.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K, dequantize

from engine.models.quantized import GROUP, QuantizedWeight


def _f16(b: np.ndarray) -> np.ndarray:  # [..., 2] uint8 -> [...] float32
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are values 0-15, high ones 16-31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes -> [..., 32] bits, value j's fifth bit at bit j (little-endian)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _simple(blocks: np.ndarray, qtype: T):
    """32-value blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0. blocks [N, B, bytes]."""
    d = _f16(blocks[..., 0:2])
    if qtype == T.Q8_0:
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
        return q, d, -128 * d, 8
    has_min = qtype in (T.Q4_1, T.Q5_1)
    start = 4 if has_min else 2
    if qtype in (T.Q4_0, T.Q4_1):
        q, bits = _nibbles(blocks[..., start:]), 4
    else:
        qh, qs = blocks[..., start : start + 4], blocks[..., start + 4 :]
        q, bits = _nibbles(qs) | (_high_bits(qh) << 4), 5
    offset = _f16(blocks[..., 2:4]) if has_min else -(2 ** (bits - 1)) * d
    return q, d, offset, bits


def _k_quant(blocks: np.ndarray, qtype: T):
    """256-value super-blocks of eight 32-value sub-blocks: Q4_K, Q5_K. blocks [N, B, bytes]."""
    n, b = blocks.shape[:2]
    flat = blocks.reshape(n * b, -1)
    d, dmin = _f16(flat[:, 0:2]), _f16(flat[:, 2:4])
    sc, m = Q4_K.get_scale_min(flat[:, 4:16])  # 6-bit scale and min per sub-block [NB, 8]
    scale = d[:, None] * sc.astype(np.float32)
    offset = -dmin[:, None] * m.astype(np.float32)
    if qtype == T.Q4_K:
        qs, bits = flat[:, 16:].reshape(-1, 4, 32), 4
        # each 32 bytes: low nibbles are sub-block 2i, high nibbles sub-block 2i + 1
        q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 256)
    else:
        qh, qs, bits = flat[:, 16:48], flat[:, 48:].reshape(-1, 4, 32), 5
        low = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)
        high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [NB, 8, 32]
        q = (low | (high << 4)).reshape(-1, 256)
    return q.reshape(n, -1), scale.reshape(n, -1), offset.reshape(n, -1), bits


_SIMPLE = {T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q8_0: 34}  # bytes per 32 values
_K_QUANTS = {T.Q4_K: 144, T.Q5_K: 176}  # bytes per 256 values
EXACT_TYPES = frozenset(_SIMPLE) | frozenset(_K_QUANTS)


def decode(raw: np.ndarray, qtype: T, in_features: int) -> QuantizedWeight:
    """raw [N, bytes per row] (or [N, K] floats for F32/F16/BF16) -> QuantizedWeight."""
    qtype = T(qtype)
    n = raw.shape[0]
    if qtype in _SIMPLE and in_features % GROUP == 0:
        q, scale, offset, bits = _simple(raw.reshape(n, -1, _SIMPLE[qtype]), qtype)
        q = q.reshape(n, -1)
    elif qtype in _K_QUANTS and in_features % 256 == 0:
        q, scale, offset, bits = _k_quant(raw.reshape(n, -1, _K_QUANTS[qtype]), qtype)
    else:
        return QuantizedWeight.quantize(dequantize_rows(raw, qtype, in_features), 8)
    return QuantizedWeight.from_codes(
        torch.from_numpy(np.ascontiguousarray(q)),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(n, -1))),
        torch.from_numpy(np.ascontiguousarray(offset.reshape(n, -1))),
        bits,
    )


def dequantize_rows(raw: np.ndarray, qtype: T, in_features: int) -> torch.Tensor:
    """gguf's own dequantization of a tensor's rows: [N, K] float32."""
    if T(qtype) in (T.F32, T.F16, T.BF16) and raw.dtype != np.uint8:
        return torch.from_numpy(np.array(raw, dtype=np.float32))  # a copy: the map is read-only
    values = dequantize(raw, T(qtype)).astype(np.float32)
    return torch.from_numpy(values.reshape(raw.shape[0], in_features))
