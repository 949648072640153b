"""Triton LoRA kernels for many adapters in one batch (SGMV style), each behind a launcher that
checks shapes and sets the grid. References: kernels/reference.lora_shrink / lora_expand.

Adapter weights sit in stacks indexed by slot (lora/batch.LoRASlots): A [S + 1, in, R] and
B [S + 1, R, out], ranks below R zero-padded, the scale folded into B. A step's rows that have an
adapter are listed grouped by slot: `rows` [n] (token rows of x, segment after segment),
`seg_starts` [G + 1] and `seg_slots` [G]; rows without an adapter are simply not listed.

- `lora_shrink`: shrunk[i] = x[rows[i]] @ A[slot of i]                     -> [n, R] fp32
- `lora_expand`: y[rows[i], offset:offset + out] += shrunk[i] @ B[slot of i]   (in place)

One program per (segment, tile of BLOCK_M rows[, tile of output columns]); a decode step's
segments are a row or a few, a prefill chunk's are long. Every row is listed once, so the
expand's read-add-write of y needs no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import dot_precision

BLOCK_M = 16  # rows per program (tl.dot's minimum)


def _check_segments(
    rows: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor, num_slots: int
) -> None:
    if rows.dim() != 1 or seg_starts.dim() != 1 or seg_slots.shape != (seg_starts.numel() - 1,):
        raise ValueError(
            f"rows must be [n], seg_starts [G + 1] and seg_slots [G], got {tuple(rows.shape)}, "
            f"{tuple(seg_starts.shape)}, {tuple(seg_slots.shape)}"
        )
    if seg_slots.is_cuda or not seg_slots.numel():  # values checked where that costs no sync
        return
    if not 0 < int(seg_slots.min()) <= int(seg_slots.max()) < num_slots:
        raise ValueError(f"seg_slots must be in [1, {num_slots}), got {seg_slots.tolist()}")


@triton.jit
def _segment_tile(rows_ptr, seg_starts_ptr, seg_slots_ptr, BLOCK_M: tl.constexpr):
    """This program's tile of its segment (program ids: segment, tile): whether the tile has
    any row, the segment's slot, the tile's positions in `rows`, their mask, and the token rows
    they name."""
    seg = tl.program_id(0)
    end = tl.load(seg_starts_ptr + seg + 1)
    first = tl.load(seg_starts_ptr + seg) + tl.program_id(1) * BLOCK_M
    offs_m = first + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    return first < end, tl.load(seg_slots_ptr + seg).to(tl.int64), offs_m, mask_m, rows


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, size_in]
    a_ptr,  # [S + 1, size_in, rank]
    out_ptr,  # [n, rank]
    rows_ptr,  # [n]
    seg_starts_ptr,  # [G + 1]
    seg_slots_ptr,  # [G]
    size_in,
    rank,
    stride_x,
    stride_as,
    stride_ai,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    live, slot, offs_m, mask_m, rows = _segment_tile(
        rows_ptr, seg_starts_ptr, seg_slots_ptr, BLOCK_M
    )
    if live:
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, size_in, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < size_in
            x = tl.load(
                x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            a = tl.load(
                a_ptr + slot * stride_as + offs_k[:, None] * stride_ai + offs_r[None, :],
                mask=mask_k[:, None] & mask_r[None, :],
                other=0.0,
            )  # [BLOCK_K, BLOCK_R]
            acc += tl.dot(x, a, input_precision=PRECISION)
        tl.store(
            out_ptr + offs_m[:, None] * stride_out + offs_r[None, :],
            acc,
            mask=mask_m[:, None] & mask_r[None, :],
        )


@triton.jit
def _lora_expand_kernel(
    shrunk_ptr,  # [n, rank]
    b_ptr,  # [S + 1, rank, size_out]
    y_ptr,  # [T, >= offset + size_out]
    rows_ptr,
    seg_starts_ptr,
    seg_slots_ptr,
    size_out,
    rank,
    y_offset,
    stride_shrunk,
    stride_bs,
    stride_br,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    live, slot, offs_m, mask_m, rows = _segment_tile(
        rows_ptr, seg_starts_ptr, seg_slots_ptr, BLOCK_M
    )
    if live:
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < size_out
        s = tl.load(
            shrunk_ptr + offs_m[:, None] * stride_shrunk + offs_r[None, :],
            mask=mask_m[:, None] & mask_r[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_R]
        b = tl.load(
            b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
            mask=mask_r[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_R, BLOCK_N]
        delta = tl.dot(s.to(b.dtype), b, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        y_ptrs = y_ptr + rows[:, None] * stride_y + y_offset + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def lora_shrink(
    x: torch.Tensor,  # [T, size_in]
    a_stack: torch.Tensor,  # [S + 1, size_in, R], contiguous
    rows: torch.Tensor,  # [n] int: rows of x with an adapter, grouped by slot
    seg_starts: torch.Tensor,  # [G + 1] int
    seg_slots: torch.Tensor,  # [G] int, each in [1, S]
    max_seg_len: int,
) -> torch.Tensor:  # [n, R] float32, in the order of rows
    if x.dim() != 2 or a_stack.dim() != 3 or a_stack.shape[1] != x.shape[1]:
        raise ValueError(
            f"x must be [T, in] and a_stack [S + 1, in, R], got {tuple(x.shape)}, "
            f"{tuple(a_stack.shape)}"
        )
    if x.stride(1) != 1 or not a_stack.is_contiguous():
        raise ValueError("x rows and a_stack must be contiguous")
    _check_segments(rows, seg_starts, seg_slots, a_stack.shape[0])
    rank = a_stack.shape[2]
    out = x.new_empty(rows.numel(), rank, dtype=torch.float32)
    if rows.numel() == 0:
        return out
    grid = (seg_slots.numel(), triton.cdiv(max_seg_len, BLOCK_M))
    _lora_shrink_kernel[grid](
        x,
        a_stack,
        out,
        rows,
        seg_starts,
        seg_slots,
        x.shape[1],
        rank,
        x.stride(0),
        a_stack.stride(0),
        a_stack.stride(1),
        out.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_K=64,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        PRECISION=dot_precision(x.dtype),
    )
    return out


def lora_expand(
    shrunk: torch.Tensor,  # [n, R], from lora_shrink
    b_stack: torch.Tensor,  # [S + 1, R, size_out], contiguous
    y: torch.Tensor,  # [T, width]: columns [y_offset, y_offset + size_out) get the update
    y_offset: int,
    rows: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int,
    block_n: int = 64,
) -> None:
    if shrunk.dim() != 2 or b_stack.dim() != 3 or b_stack.shape[1] != shrunk.shape[1]:
        raise ValueError(
            f"shrunk must be [n, R] and b_stack [S + 1, R, out], got {tuple(shrunk.shape)}, "
            f"{tuple(b_stack.shape)}"
        )
    size_out = b_stack.shape[2]
    if y.dim() != 2 or y.stride(1) != 1 or not 0 <= y_offset <= y.shape[1] - size_out:
        raise ValueError(
            f"y must be [T, width] with contiguous rows and columns [{y_offset}, "
            f"{y_offset + size_out}) inside it, got {tuple(y.shape)}"
        )
    if shrunk.shape[0] != rows.numel() or not b_stack.is_contiguous():
        raise ValueError(
            f"shrunk must have a row per listed row ({rows.numel()}), got {shrunk.shape[0]}; "
            "b_stack must be contiguous"
        )
    _check_segments(rows, seg_starts, seg_slots, b_stack.shape[0])
    if rows.numel() == 0:
        return
    grid = (seg_slots.numel(), triton.cdiv(max_seg_len, BLOCK_M), triton.cdiv(size_out, block_n))
    _lora_expand_kernel[grid](
        shrunk,
        b_stack,
        y,
        rows,
        seg_starts,
        seg_slots,
        size_out,
        shrunk.shape[1],
        y_offset,
        shrunk.stride(0),
        b_stack.stride(0),
        b_stack.stride(1),
        y.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(shrunk.shape[1])),
        PRECISION=dot_precision(y.dtype),
    )
