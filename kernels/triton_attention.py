"""Triton kernels over the paged KV cache, each behind a launcher that checks shapes and sets
the grid. Their pure-torch references are in kernels/reference.py (the CPU path).

Cache layout (as the reference): per layer, K and V each [num_kv_heads, num_blocks, block_size,
head_dim]; slot = block * block_size + offset; block 0 is the null block.

- `store_kv`: write new tokens' K/V at their slots (slot -1: padding, skipped).
- `paged_attention`: variable-length queries over paged KV with causal masking, one launch for
  a batch that mixes decodes (1 query), speculative verification (1 + k queries) and prefill
  chunks (many queries); GQA. One program per (request, query tile, KV head) serving every
  query head of the group; it walks the request's blocks with an online softmax and stops at
  the last key its queries may see.
- A sliding window W (a constexpr; 0: none, compiled away): a query at position p sees the keys
  at p - W < k <= p (kernels.reference.causal_mask), and a program starts at the block holding
  its first query's first visible key, so a long context costs only the window.

Split-KV decode (one query per request) is in kernels/triton_decode.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import dot_precision

# Elements of a varlen program's [rows, head_dim] query and output tiles, rows being query
# tokens x query heads of a KV group: 64 rows at head dim 64, 32 at 128 (more spills on a GPU).
VARLEN_TILE = 4096


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(
            f"k_cache/v_cache must be contiguous and alike, got {tuple(k_cache.shape)}, "
            f"{tuple(v_cache.shape)}"
        )


def _check_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """q [..., Hq, D] against a cache [Hkv, num_blocks, block_size, D]."""
    _check_cache(k_cache, v_cache)
    num_heads, head_dim = q.shape[-2:]
    num_kv_heads, _, block_size, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q heads/dim {num_heads}/{head_dim} do not fit the cache's {num_kv_heads}/{cache_dim}"
        )
    if block_size & (block_size - 1) or block_size < 16:
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")


def check_window(sliding_window: int | None) -> int:
    """The kernels' WINDOW constexpr: 0 for no window."""
    if sliding_window is None:
        return 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    return sliding_window


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_t,  # k/v token stride
    stride_h,  # k/v head stride
    stride_ch,  # cache head stride
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        d = tl.arange(0, BLOCK_D)
        inside = d < HEAD_DIM
        src = token * stride_t + head * stride_h + d
        # int64: a layer's cache can pass 2^31 elements (a shallow model's pool is huge)
        dst = head.to(tl.int64) * stride_ch + slot.to(tl.int64) * HEAD_DIM + d
        tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=inside), mask=inside)
        tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=inside), mask=inside)


def store_kv(
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D], contiguous
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int, -1 for padding tokens
) -> None:
    num_kv_heads, _, _, head_dim = k_cache.shape
    num_tokens = k.shape[0]
    _check_cache(k_cache, v_cache)
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"k/v must be [T, {num_kv_heads}, {head_dim}], got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    k, v = k.contiguous(), v.contiguous()
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        k_cache.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _attend_block(
    q,  # [ROWS, BLOCK_D] fp32
    q_pos,  # [ROWS] absolute position of each query row
    row_max,  # [ROWS] running max, row_sum [ROWS], acc [ROWS, BLOCK_D]: the online softmax
    row_sum,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    block,  # physical block id
    j,  # its index in the request's block table
    kv_head,
    stride_ch,
    seq_len,
    scale,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's: "ieee" for a float32 cache (no TF32 rounding)
    WINDOW: tl.constexpr,  # sliding window, 0: none
):
    """One block of keys into the running softmax: keys past seq_len, after a row's own
    position or (WINDOW > 0) at or before its position - WINDOW are hidden. `block` is int64:
    offsets into a layer's cache can pass 2^31."""
    offs = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, BLOCK_D)
    k_pos = j * BLOCK_SIZE + offs
    base = kv_head.to(tl.int64) * stride_ch + (block * BLOCK_SIZE + offs)[:, None] * HEAD_DIM
    base += d[None, :]
    kv_mask = (k_pos < seq_len)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + base, mask=kv_mask, other=0.0).to(tl.float32)
    v = tl.load(v_cache_ptr + base, mask=kv_mask, other=0.0).to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [ROWS, BLOCK_SIZE]
    visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
    if WINDOW > 0:
        visible &= k_pos[None, :] > q_pos[:, None] - WINDOW
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    # Rows that have seen nothing yet keep a max of -inf: guard the exponentials.
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    correction = tl.exp(row_max - safe_max)
    p = tl.exp(scores - safe_max[:, None])
    row_sum = row_sum * correction + tl.sum(p, axis=1)
    acc = acc * correction[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return new_max, row_sum, acc


@triton.jit
def _attend_blocks(
    q,  # [ROWS, BLOCK_D] fp32
    q_pos,  # [ROWS] absolute position of each query row
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,  # the request's row of the block table
    first,  # blocks [first, last) of the request
    last,
    kv_head,
    stride_ch,
    seq_len,
    scale,
    ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """The online softmax over a run of the request's blocks: (row max, row sum, unnormalised
    output [ROWS, BLOCK_D]); a row that saw no key has sum 0."""
    row_max = tl.full([ROWS], float("-inf"), tl.float32)
    row_sum = tl.full([ROWS], 0.0, tl.float32)
    acc = tl.full([ROWS, BLOCK_D], 0.0, tl.float32)
    for j in range(first, last):
        block = tl.load(table_ptr + j).to(tl.int64)
        row_max, row_sum, acc = _attend_block(
            q,
            q_pos,
            row_max,
            row_sum,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            block,
            j,
            kv_head,
            stride_ch,
            seq_len,
            scale,
            BLOCK_SIZE,
            HEAD_DIM,
            BLOCK_D,
            PRECISION,
            WINDOW,
        )
    return row_max, row_sum, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [Hkv, NB, BS, D]
    v_cache_ptr,
    out_ptr,  # [T, Hq, D]
    block_tables_ptr,  # [B, max_blocks]
    query_start_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    scale,
    stride_qt,
    stride_qh,
    stride_ch,  # cache head stride
    stride_bt,  # block table row stride
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per program
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,  # sliding window, 0: none
):
    """One program per (request, tile of BLOCK_M query tokens, KV head): its rows are every
    (token, query head of the group) pair, so each block of K/V is read once for the whole
    group rather than once per query head."""
    req = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - q_len
        r = tl.arange(0, BLOCK_M * BLOCK_G)  # row = token * BLOCK_G + head in the group
        m = tile * BLOCK_M + r // BLOCK_G  # query index within the request
        g = r % BLOCK_G
        valid = (m < q_len) & (g < GROUP)
        d = tl.arange(0, BLOCK_D)
        mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        offsets = (q_start + m)[:, None] * stride_qt + (kv_head * GROUP + g)[:, None] * stride_qh
        q = tl.load(q_ptr + offsets + d[None, :], mask=mask, other=0.0).to(tl.float32)
        q_pos = context_len + m  # absolute positions of the queries
        # Keys up to the last query's position: the tile's causal horizon.
        last = tl.minimum(context_len + (tile + 1) * BLOCK_M, seq_len)
        first = 0
        if WINDOW > 0:  # from the block of the first query's first visible key
            first = tl.maximum(context_len + tile * BLOCK_M - WINDOW + 1, 0) // BLOCK_SIZE
        _, row_sum, acc = _attend_blocks(
            q,
            q_pos,
            k_cache_ptr,
            v_cache_ptr,
            block_tables_ptr + req * stride_bt,
            first,
            (last + BLOCK_SIZE - 1) // BLOCK_SIZE,
            kv_head,
            stride_ch,
            seq_len,
            scale,
            BLOCK_M * BLOCK_G,
            BLOCK_SIZE,
            HEAD_DIM,
            BLOCK_D,
            PRECISION,
            WINDOW,
        )
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(out_ptr + offsets + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]: every request's new query tokens, request after request
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int, padded with the null block 0
    query_start_loc: torch.Tensor,  # [B + 1] int: request b's queries are q[start[b]:start[b+1]]
    seq_lens: torch.Tensor,  # [B] int: tokens with KV in the cache, the new ones included
    scale: float,
    max_query_len: int,
    sliding_window: int | None = None,  # a query at p sees keys p - window < k <= p
) -> torch.Tensor:  # [T, Hq, D]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    num_reqs = block_tables.shape[0]
    _check_attention(q, k_cache, v_cache)
    if query_start_loc.shape != (num_reqs + 1,) or seq_lens.shape != (num_reqs,):
        raise ValueError(
            f"query_start_loc must be [{num_reqs + 1}] and seq_lens [{num_reqs}], got "
            f"{tuple(query_start_loc.shape)}, {tuple(seq_lens.shape)}"
        )
    window = check_window(sliding_window)
    out = torch.empty_like(q)
    if num_tokens == 0 or num_reqs == 0:
        return out
    block_g = triton.next_power_of_2(num_heads // num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    block_m = varlen_block_m(max_query_len, block_g, block_d)
    grid = (num_reqs, triton.cdiv(max(max_query_len, 1), block_m), num_kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        BLOCK_G=block_g,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        PRECISION=dot_precision(k_cache.dtype),
        WINDOW=window,
    )
    return out


def varlen_block_m(max_query_len: int, block_g: int, block_d: int) -> int:
    """Query tokens per program: the longest query rounded up to a power of two, at most what
    keeps tokens x padded group x head dim within VARLEN_TILE, and at least 16 rows (tl.dot's
    minimum)."""
    most = max(1, VARLEN_TILE // (block_g * block_d))
    return max(min(triton.next_power_of_2(max(max_query_len, 1)), most), triton.cdiv(16, block_g))
