"""The int8 KV cache's torch reference (the kernel: kernels/cpu/kv_int8.h, read and written by
the C++ layers' rope_store and attend): its layout, a row's quantization, the store, and the
cache dequantized to floats for plain softmax attention (the test oracle).

Each (kv head, slot) row of D values is D int8 codes and a float32 scale per group of G values,
symmetric: s = max|x| / 127 over the group, code = round-half-even(x / s), so x ~ code s within
s / 2 per value (a zero group: s = 0, codes 0; a group holding a non-finite value: s = NaN,
codes 0). Keys are in groups of KEY_GROUP = 8 (the rotated keys' outlier dims would take the
levels of a wider group: engine/models/kv_cache.py), values of 32 (16 or 8 where D is not a
multiple of 32). A layer's K cache and its V cache are int8 tensors [Hkv, num_blocks,
block_size, D + 4 D / G], each with its own G: each (head, block) holds the codes (keys
transposed, [D, block_size]; values [block_size, D]), then the scales as float32
[D / G, block_size].
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # a float32 scale per group
KEY_GROUP = 8  # a key's values per scale (kv_int8.h: kKeyGroup)


def scale_group(head_dim: int, is_key: bool) -> int:
    """Values per scale: a key's KEY_GROUP; a value's 32, or the largest of 16 and 8 that
    divides head_dim."""
    if is_key:
        return KEY_GROUP
    return next(g for g in (32, 16, 8) if head_dim % g == 0)


def row_bytes(head_dim: int, is_key: bool) -> int:
    """A key's or value's row of bytes in the cache: its codes and its groups' scales."""
    return head_dim + SCALE_BYTES * (head_dim // scale_group(head_dim, is_key))


def quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] float32 -> (codes [N, D] int8, scales [N, D / group] float32), as the kernel
    rounds."""
    n, d = x.shape
    groups = x.view(n, -1, group)  # [N, D / G, G]
    scales = groups.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scales > 0, torch.round(groups / scales), 0)
    finite = torch.isfinite(groups).all(-1, keepdim=True)
    codes = torch.where(finite, codes, 0).to(torch.int8).view(n, d)
    return codes, torch.where(finite, scales, float("nan")).squeeze(-1)


def codes_and_scales(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a cache [Hkv, num_blocks, block_size, row_bytes]: its codes [Hkv, num_blocks,
    block_size D] and its scales' bytes [Hkv, num_blocks, 4 block_size D / G]."""
    num_kv_heads, num_blocks, block_size, _ = cache.shape
    flat = cache.view(num_kv_heads, num_blocks, -1)
    return flat[..., : block_size * head_dim], flat[..., block_size * head_dim :]


def store(
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, row_bytes(D, True)] int8
    v_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, row_bytes(D, False)] int8
    k: torch.Tensor,  # [N, Hkv, D] float32
    v: torch.Tensor,  # [N, Hkv, D] float32
    slot_mapping: torch.Tensor,  # [N] int64
) -> None:
    """Quantize and store the tokens' keys and values at their slots."""
    n, num_kv_heads, d = k.shape
    bs = k_cache.shape[2]
    blocks, offsets = slot_mapping // bs, slot_mapping % bs  # [N]
    for cache, x, is_key in ((k_cache, k, True), (v_cache, v, False)):
        group = scale_group(d, is_key)
        num_groups = d // group
        codes_at, scales_at = codes_and_scales(cache, d)
        codes, scales = quantize_rows(x.reshape(n * num_kv_heads, d), group)
        i = torch.arange(d)
        at = i[None] * bs + offsets[:, None] if is_key else offsets[:, None] * d + i[None]  # [N, D]
        codes_at[:, blocks[:, None], at] = codes.view(n, num_kv_heads, d).transpose(0, 1)
        # group j of slot t: bytes 4 (j bs + t) .. + 3
        slot_of = torch.arange(num_groups)[None, :, None] * bs + offsets[:, None, None]
        byte_at = (SCALE_BYTES * slot_of + torch.arange(SCALE_BYTES)).view(n, -1)  # [N, 4 G']
        scale_bytes = scales.contiguous().view(torch.int8).view(n, num_kv_heads, -1)
        scales_at[:, blocks[:, None], byte_at] = scale_bytes.transpose(0, 1)


def dequantize(cache: torch.Tensor, head_dim: int, is_key: bool) -> torch.Tensor:
    """The cache's rows as floats, [Hkv, num_blocks, block_size, D] (the float cache's
    reference layout, kernels/reference.py): code s for every value."""
    num_kv_heads, num_blocks, bs, _ = cache.shape
    d, group = head_dim, scale_group(head_dim, is_key)
    codes, scale_bytes = codes_and_scales(cache, d)
    codes = codes.float()
    if is_key:
        codes = codes.view(num_kv_heads, num_blocks, d, bs).transpose(2, 3)
    else:
        codes = codes.view(num_kv_heads, num_blocks, bs, d)
    scales = scale_bytes.contiguous().view(torch.float32).view(num_kv_heads, num_blocks, -1, bs)
    return codes * scales.transpose(2, 3).repeat_interleave(group, dim=-1)
