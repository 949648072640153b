"""The Triton kernels' references in plain PyTorch, their test oracles: paged attention (also the
CPU path), LoRA shrink/expand and batched rejection-sampling verification.

Cache layout, per layer and for K and V alike: [num_kv_heads, num_blocks, block_size, head_dim].
Head-major so that gathering a request's blocks along dim 1 yields [num_kv_heads, seq_len,
head_dim] with no further permute: the gathered copy feeds batched matmuls directly. A slot is
`block_id * block_size + offset`; block 0 is the null block that pads block tables.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D]
    v_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D]
    k: torch.Tensor,  # [num_tokens, Hkv, D]
    v: torch.Tensor,  # [num_tokens, Hkv, D]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    num_kv_heads, _, _, head_dim = k_cache.shape
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def decode_attention(
    q: torch.Tensor,  # [B, Q, Hq, D], a few query tokens per request (decode: Q = 1)
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64, padded with the null block 0
    key_bias: torch.Tensor,  # [B, max_blocks * block_size, Q] float, 0 where visible, -inf else
    scale: float,
) -> torch.Tensor:  # [B, Q, Hq, D]
    """Attention of B requests with Q queries each over their paged K/V, in batched matmuls.

    Serves decode (Q = 1) and speculative verification (Q = 1 + drafts); the causal order among
    the Q queries lives in key_bias. Every request is padded to max_blocks, so callers group
    requests of similar length (see engine.attention) to keep the padding small.
    """
    num_reqs, num_queries, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_len = block_tables.shape[1] * block_size
    flat_blocks = block_tables.reshape(-1)
    # Gathered copies: [Hkv, B, max_len, D] -> batch (Hkv * B) of [max_len, D].
    k = k_cache.index_select(1, flat_blocks).view(num_kv_heads * num_reqs, max_len, head_dim)
    v = v_cache.index_select(1, flat_blocks).view(num_kv_heads * num_reqs, max_len, head_dim)
    # q as [Hkv * B, D, group * Q]: the scores come out [Hkv * B, max_len, group * Q], so K is
    # read in its natural layout (no transposed copy of the large operand).
    q_t = q.view(num_reqs, num_queries, num_kv_heads, group, head_dim).permute(2, 0, 4, 3, 1)
    q_t = q_t.reshape(num_kv_heads * num_reqs, head_dim, group * num_queries) * scale
    scores = torch.bmm(k, q_t).view(num_kv_heads, num_reqs, max_len, group, num_queries)
    scores = scores.float() + key_bias[None, :, :, None, :]  # softmax in float32 (no-op on fp32)
    probs = scores.softmax(dim=2).to(v.dtype)
    probs = probs.view(num_kv_heads * num_reqs, max_len, group * num_queries)
    out = torch.bmm(probs.transpose(1, 2), v)  # [Hkv * B, group * Q, D]
    return (
        out.view(num_kv_heads, num_reqs, group, num_queries, head_dim)
        .permute(1, 3, 0, 2, 4)
        .reshape(num_reqs, num_queries, num_heads, head_dim)
    )


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D], the request's new query tokens
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D]
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,  # [num_blocks_of_request] int64
    seq_len: int,  # tokens with KV in the cache after this step (context + T)
    mask: torch.Tensor,  # [T, seq_len] bool, True where a query may see a key
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    k = k_cache.index_select(1, block_ids).view(num_kv_heads, -1, head_dim)[:, :seq_len]
    v = v_cache.index_select(1, block_ids).view(num_kv_heads, -1, head_dim)[:, :seq_len]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, Hq, T, D]
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out[0].transpose(0, 1)


def causal_mask(
    context_len: int, num_tokens: int, sliding_window: int | None = None, device=None
) -> torch.Tensor:  # [num_tokens, context_len + num_tokens] bool
    """Query i (absolute position context_len + i) sees keys at positions <= its own."""
    q_pos = torch.arange(context_len, context_len + num_tokens, device=device)[:, None]
    k_pos = torch.arange(context_len + num_tokens, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def varlen_paged_attention(
    q: torch.Tensor,  # [T, Hq, D], request after request
    k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    query_start_loc: torch.Tensor,  # [B + 1] int
    seq_lens: torch.Tensor,  # [B] int, new tokens included
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """The reference of kernels.triton_attention.paged_attention: request by request, causal
    (within the sliding window, if any) over its context plus its new tokens."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[2]
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        blocks = block_tables[b, : -(-seq_len // block_size)].long()
        mask = causal_mask(seq_len - (hi - lo), hi - lo, sliding_window, q.device)
        out[lo:hi] = prefill_attention(q[lo:hi], k_cache, v_cache, blocks, seq_len, mask, scale)
    return out


def lora_shrink(
    x: torch.Tensor,  # [T, size_in]
    a_stack: torch.Tensor,  # [S + 1, size_in, R]
    rows: torch.Tensor,  # [n] int64: rows of x with an adapter, grouped by slot
    seg_starts: list[int],  # [G + 1]
    seg_slots: list[int],  # [G]
) -> torch.Tensor:  # [n, R] float32
    """Each segment's rows of x times its adapter's A (the Triton SGMV shrink's oracle)."""
    out = x.new_zeros(rows.numel(), a_stack.shape[2], dtype=torch.float32)
    for g, slot in enumerate(seg_slots):
        lo, hi = seg_starts[g], seg_starts[g + 1]
        out[lo:hi] = x[rows[lo:hi]].float() @ a_stack[slot].float()
    return out


def lora_expand(
    shrunk: torch.Tensor,  # [n, R] float32
    b_stack: torch.Tensor,  # [S + 1, R, size_out]
    y: torch.Tensor,  # [T, width], updated in place in columns [y_offset, y_offset + size_out)
    y_offset: int,
    rows: torch.Tensor,
    seg_starts: list[int],
    seg_slots: list[int],
) -> None:
    """y[rows, offset:offset + out] += shrunk @ B per segment (the Triton SGMV expand's oracle)."""
    size_out = b_stack.shape[2]
    for g, slot in enumerate(seg_slots):
        lo, hi = seg_starts[g], seg_starts[g + 1]
        delta = shrunk[lo:hi].to(b_stack.dtype).float() @ b_stack[slot].float()
        cols = y[:, y_offset : y_offset + size_out]
        cols[rows[lo:hi]] = (cols[rows[lo:hi]].float() + delta).to(y.dtype)


def rejection_verify(
    probs: torch.Tensor,  # [R, V] float32 target p per row; greedy requests' rows: any scores
    draft_ids: torch.Tensor,  # [R] int64: the draft after each row (a request's last row: unused)
    draft_probs: torch.Tensor | None,  # [R, V] float32 q, read on the rows of has_q requests
    cu_rows: torch.Tensor,  # [B + 1] int64: request b owns rows cu_rows[b]:cu_rows[b + 1]
    is_greedy: torch.Tensor,  # [B] bool
    has_q: torch.Tensor,  # [B] bool: drafts were sampled from q (else one-hot drafts)
    uniforms: torch.Tensor,  # [R] float32 U(0, 1), the accept test's draw on has_q rows
    noise: torch.Tensor,  # [R, V] float32 Exp(1), the race of the row where a token is drawn
    max_rows: int,  # the largest 1 + drafts in the batch
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [B, max_rows] (-1 past the emitted), [B]
    """engine.rejection.verify over a whole batch given its random draws (the oracle of
    kernels.triton_rejection). Every row first draws its candidate: the argmax on greedy rows,
    else the race argmax w / E with w = max(p - q, 0) on has_q rows before the last (p when
    that residual is empty) and w = p elsewhere. Draft j is accepted on greedy and one-hot rows
    iff it equals the candidate, on has_q rows iff u * q(x) < p(x) (in float64, as spec's
    Python floats); the first rejected row, or the last row, emits its candidate."""
    num_rows, device = probs.shape[0], probs.device
    num_reqs = cu_rows.numel() - 1
    num_drafts = cu_rows.diff() - 1  # [B]
    # No step here waits for the device (on CUDA this is the torch backend's verification,
    # queued inside the step's launch): output sizes are given, masks are applied by where.
    request = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), num_drafts + 1, output_size=num_rows
    )
    pos = torch.arange(num_rows, device=device) - cu_rows[request]  # [R] j within the request
    is_last = pos == num_drafts[request]
    greedy_row = is_greedy[request]
    q_row = has_q[request] & ~greedy_row
    residual_row = q_row & ~is_last
    weights = probs
    if draft_probs is not None:
        residual = (probs - draft_probs).clamp(min=0.0)
        use = residual_row & (residual > 0).any(dim=-1)
        weights = torch.where(use[:, None], residual, probs)
    candidate = torch.where(greedy_row, probs.argmax(-1), (weights / noise).argmax(-1))  # [R]
    drafts = draft_ids.clamp(min=0)
    accept = candidate == drafts
    if draft_probs is not None:
        p_x = probs.gather(1, drafts[:, None])[:, 0].double()
        q_x = draft_probs.gather(1, drafts[:, None])[:, 0].double()
        accept = torch.where(q_row, uniforms.double() * q_x < p_x, accept)
    accept &= ~is_last
    # Accepted drafts per request: the run of accepted rows before its first rejection.
    table = torch.zeros(num_reqs, max_rows, dtype=torch.bool, device=device)
    table[request, pos] = accept
    num_accepted = table.int().cumprod(dim=1).sum(dim=1)  # [B]
    tokens = torch.full((num_reqs, max_rows), -1, dtype=torch.int64, device=device)
    tokens[request, pos] = torch.where(pos < num_accepted[request], drafts, candidate)
    cols = torch.arange(max_rows, device=device)[None, :]
    return tokens.masked_fill(cols > num_accepted[:, None], -1), num_accepted
