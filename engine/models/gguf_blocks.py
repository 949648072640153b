"""GGUF quantized blocks -> QuantizedWeight (engine/models/quantized.py), without a float detour
where the block's codes fit.

Each decoder reads a tensor's raw rows ([N, bytes per row] uint8, as the GGUF loader maps them)
and returns the block's own integer codes and scales, exactly: Q4_0, Q4_1, Q4_K (4-bit codes),
Q5_0, Q5_1, Q5_K (5-bit), Q6_K (6-bit) and Q8_0 (8-bit), w = scale q + offset per 32 values
(Q6_K: w = s (q - 32) per 16). The K-quants keep their file's float16 d (and dmin) per 256
values with 6-bit (Q6_K: int8) sub-scales (`SuperBlocks`), the form the C++ kernel holds;
torch's int4 kernel, where it is the backend, rounds scales to bf16 and takes Q6_K requantized
(`QuantizedWeight.affine`). Every other type gguf can dequantize (Q2_K, Q3_K, IQ*, F16, ...)
is requantized to 8 bits per 32 values: an error of at most a 510th of each group's range,
below the source format's own step.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K, dequantize

from engine.models.quantized import GROUP, SUPER, QuantizedWeight, SuperBlocks


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
    """256-value super-blocks of eight 32-value sub-blocks: Q4_K, Q5_K. blocks [N, B, bytes].
    Returns codes [N, K] and the scales as the file holds them (SuperBlocks)."""
    n, b = blocks.shape[:2]
    flat = blocks.reshape(n * b, -1)
    d = np.ascontiguousarray(flat[:, 0:2]).view(np.float16)  # [NB, 1]
    neg_dmin = -np.ascontiguousarray(flat[:, 2:4]).view(np.float16)  # exact: a sign flip
    sc, m = Q4_K.get_scale_min(flat[:, 4:16])  # 6-bit scale and min per sub-block [NB, 8]
    if qtype == T.Q4_K:
        qs, bits = flat[:, 16:].reshape(-1, 4, 32), 4
        # each 32 bytes: low nibbles are sub-block 2i, high nibbles sub-block 2i + 1
        q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 256)
    else:
        qh, qs, bits = flat[:, 16:48], flat[:, 48:].reshape(-1, 4, 32), 5
        low = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)
        high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [NB, 8, 32]
        q = (low | (high << 4)).reshape(-1, 256)

    def rows(a: np.ndarray) -> torch.Tensor:  # [NB, ...] -> [N, B ...]
        return torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1))

    blocks = SuperBlocks(
        rows(d), rows(sc.astype(np.uint8)), rows(neg_dmin), rows(m.astype(np.uint8))
    )
    return rows(q), blocks, bits


def _q6_k(blocks: np.ndarray) -> tuple[torch.Tensor, SuperBlocks]:
    """Q6_K's 256-value super-blocks: 6-bit codes q (low 4 bits in ql, high 2 in qh), a signed
    8-bit scale per 16 values and a float16 d: w = d sc (q - 32). blocks [N, B, 210]."""
    n, b = blocks.shape[:2]
    flat = blocks.reshape(n * b, -1)
    ql, qh, sc, d = flat[:, :128], flat[:, 128:192], flat[:, 192:208], flat[:, 208:]
    # as gguf's own Q6_K.dequantize_blocks: each 64 ql bytes give 128 values (low nibbles,
    # then high), each 32 qh bytes four times 32 values (bits 0-1, 2-3, 4-5, 6-7)
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 15
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    q = low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)

    def rows(a: np.ndarray) -> torch.Tensor:  # [NB, ...] -> [N, B ...]
        return torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1))

    d16 = np.ascontiguousarray(d).view(np.float16)
    return rows(q), SuperBlocks(rows(d16), rows(sc.view(np.int8)), None, None)


_SIMPLE = {T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q8_0: 34}  # bytes per 32 values
_K_QUANTS = {T.Q4_K: 144, T.Q5_K: 176}  # bytes per 256 values
EXACT_TYPES = frozenset(_SIMPLE) | frozenset(_K_QUANTS) | {T.Q6_K}


def decode(raw: np.ndarray, qtype: T, in_features: int) -> QuantizedWeight:
    """raw [N, bytes per row] (or [N, K] floats for F32/F16/BF16) -> QuantizedWeight."""
    qtype = T(qtype)
    n = raw.shape[0]
    if qtype in _SIMPLE and in_features % GROUP == 0:
        q, scale, offset, bits = _simple(raw.reshape(n, -1, _SIMPLE[qtype]), qtype)
        q = q.reshape(n, -1)
    elif qtype in _K_QUANTS and in_features % SUPER == 0:
        q, blocks, bits = _k_quant(raw.reshape(n, -1, _K_QUANTS[qtype]), qtype)
        return QuantizedWeight.from_super_blocks(q, blocks, bits)
    elif qtype == T.Q6_K and in_features % SUPER == 0:
        q, blocks = _q6_k(raw.reshape(n, -1, 210))
        return QuantizedWeight.from_super_blocks(q, blocks, 6)
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
