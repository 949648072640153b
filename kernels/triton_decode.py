"""Split-KV decode attention over the paged KV cache (kernels/triton_attention.py's layout):
one query per request, each context split across programs and merged by log-sum-exp; one
program serves all query heads of a KV head. The number of splits follows the batch's shape,
each split's length the request's context, or under a sliding window W (a constexpr, 0: none)
the blocks that hold its last W keys. Reference: kernels/reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_attention import _attend_blocks, _check_attention, check_window
from kernels.triton_common import dot_precision

# Split-KV decode: how many (request, KV head, split) programs to aim for (a few per SM slot of
# an H100's 132 SMs), the most splits per request, and how many splits the merge reads per
# iteration ([MERGE_SPLITS, head_dim] fp32 stays in registers).
DECODE_PROGRAMS = 2048
MAX_SPLITS = 64
MERGE_SPLITS = 32


@triton.jit
def _split_size(seq_len, num_splits, BLOCK_SIZE: tl.constexpr, WINDOW: tl.constexpr):
    """(first block, end block, blocks per split): the request's blocks that the decode query
    sees (all of them, or from the one holding key seq_len - WINDOW), cut into num_splits runs
    of equal length, so a split's work follows the request's context, not the width of the
    block table (a CUDA graph's table is as wide as the longest context allowed)."""
    end = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    first = 0
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0) // BLOCK_SIZE
    return first, end, tl.maximum((end - first + num_splits - 1) // num_splits, 1)


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [Hkv, NB, BS, D]
    v_cache_ptr,
    part_out_ptr,  # [B, Hq, S, D] fp32: each live split's normalised output
    part_lse_ptr,  # [B, Hq, S] fp32: each live split's log-sum-exp
    block_tables_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    scale,
    stride_qb,
    stride_qh,
    stride_ch,
    stride_bt,
    num_splits,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum)
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,  # sliding window, 0: none
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    start, end, per_split = _split_size(seq_len, num_splits, BLOCK_SIZE, WINDOW)
    first = start + split * per_split
    last = tl.minimum(first + per_split, end)
    if first < last:  # splits past the request's blocks store nothing; the merge skips them
        g = tl.arange(0, BLOCK_G)
        g_valid = g < GROUP
        heads = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        d_valid = d < HEAD_DIM
        q = tl.load(
            q_ptr + req * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=g_valid[:, None] & d_valid[None, :],
            other=0.0,
        ).to(tl.float32)
        q_pos = tl.full([BLOCK_G], 0, tl.int32) + seq_len - 1  # the decode query sees every key
        row_max, row_sum, acc = _attend_blocks(
            q,
            q_pos,
            k_cache_ptr,
            v_cache_ptr,
            block_tables_ptr + req * stride_bt,
            first,
            last,
            kv_head,
            stride_ch,
            seq_len,
            scale,
            BLOCK_G,
            BLOCK_SIZE,
            HEAD_DIM,
            BLOCK_D,
            PRECISION,
            WINDOW,
        )
        # Each live split holds a key the decode query sees (the first split's first block holds
        # the window's first key): row_sum > 0.
        row = (req * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(
            part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
            acc / row_sum[:, None],
            mask=g_valid[:, None] & d_valid[None, :],
        )
        tl.store(part_lse_ptr + row, row_max + tl.log(row_sum), mask=g_valid)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,  # [B, Hq, S, D]
    part_lse_ptr,  # [B, Hq, S]
    out_ptr,  # [B, Hq, D]
    seq_lens_ptr,  # [B]
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_S: tl.constexpr,  # splits merged per iteration
    WINDOW: tl.constexpr,
):
    """The live splits' outputs weighted by their share of the softmax, BLOCK_S splits at a
    time with a running maximum (a long context's many splits in one tile would spill)."""
    row = tl.program_id(0)  # b * Hq + h
    seq_len = tl.load(seq_lens_ptr + row // num_heads)
    first, end, per_split = _split_size(seq_len, num_splits, BLOCK_SIZE, WINDOW)
    live = (end - first + per_split - 1) // per_split  # splits that stored a result
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    top = float("-inf")  # the largest log-sum-exp so far
    total = 0.0  # sum of exp(lse - top) so far
    acc = tl.zeros([BLOCK_D], tl.float32)  # sum of exp(lse - top) * output so far
    for first in range(0, live, BLOCK_S):
        s = first + tl.arange(0, BLOCK_S)
        s_valid = s < live
        lse = tl.load(part_lse_ptr + row * num_splits + s, mask=s_valid, other=float("-inf"))
        new_top = tl.maximum(top, tl.max(lse, axis=0))
        correction = tl.exp(top - new_top)  # new_top is finite: the tile has a live split
        weights = tl.exp(lse - new_top)  # 0 for the padding past the live splits
        parts = tl.load(
            part_out_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
            mask=s_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        acc = acc * correction + tl.sum(parts * weights[:, None], axis=0)
        total = total * correction + tl.sum(weights, axis=0)
        top = new_top
    out = acc / tl.where(total == 0.0, 1.0, total)  # total 0: no key at all (seq_len 0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_valid)


def decode_splits(num_reqs: int, num_kv_heads: int, max_blocks: int) -> int:
    """Splits per request: enough (request, KV head, split) programs to keep a large GPU busy,
    never more than the widest context has blocks. Depends on the batch's shape alone, so a
    CUDA graph captured for a batch size serves every context length."""
    wanted = triton.cdiv(DECODE_PROGRAMS, max(1, num_reqs * num_kv_heads))
    return max(1, min(MAX_SPLITS, wanted, max_blocks))


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D], one query per request
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    seq_lens: torch.Tensor,  # [B] int, >= 1 (the query's own key included)
    scale: float,
    num_splits: int | None = None,  # default: decode_splits
    sliding_window: int | None = None,  # the query at p sees keys p - window < k <= p
) -> torch.Tensor:  # [B, Hq, D]
    """Decode attention with each request's context cut into num_splits runs of blocks, one
    program each, the partial results merged by their log-sum-exp: long contexts use many
    programs instead of one. Each program serves all query heads of one KV head (GQA)."""
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    _check_attention(q, k_cache, v_cache)
    if block_tables.shape[0] != num_reqs or seq_lens.shape != (num_reqs,):
        raise ValueError(
            f"block_tables must be [{num_reqs}, max_blocks] and seq_lens [{num_reqs}], got "
            f"{tuple(block_tables.shape)}, {tuple(seq_lens.shape)}"
        )
    window = check_window(sliding_window)
    if num_splits is None:
        max_blocks = block_tables.shape[1]
        if window:  # the most blocks a window's keys can touch
            max_blocks = min(max_blocks, (window + block_size - 2) // block_size + 1)
        num_splits = decode_splits(num_reqs, num_kv_heads, max_blocks)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty_like(q)
    if num_reqs == 0:
        return out
    q = q.contiguous()
    part_out = torch.empty(num_reqs, num_heads, num_splits, head_dim, device=q.device)
    part_lse = torch.empty(num_reqs, num_heads, num_splits, device=q.device)
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        part_out,
        part_lse,
        block_tables,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        block_tables.stride(0),
        num_splits,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PRECISION=dot_precision(k_cache.dtype),
        WINDOW=window,
    )
    _decode_merge_kernel[(num_reqs * num_heads,)](
        part_out,
        part_lse,
        out,
        seq_lens,
        num_heads,
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_S=min(MERGE_SPLITS, max(2, triton.next_power_of_2(num_splits))),
        WINDOW=window,
    )
    return out
