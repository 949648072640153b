"""Fused speculative verification (rejection sampling) in two launches behind one launcher that
checks shapes and sets the grids. Reference: kernels/reference.rejection_verify, which is
engine.rejection.verify over a whole batch given the same random draws.

A batch of B requests owns R = sum(1 + drafts) rows of target probabilities p; row j of a request
scored the prefix ending at its draft j (the last row: the bonus position).

- `_candidate_kernel`, one program per (request, row): the token the row emits should the walk
  stop there. Greedy requests: the argmax. Others: the exponential race, argmax w / E over the
  vocabulary in tiles, with w = max(p - q, 0) on a draft row of a request whose drafts were
  sampled from q (p instead where that residual is empty) and w = p elsewhere. Rows past a
  rejection are drawn too, in parallel: this is the pass over the vocabulary, the walk is not.
- `_accept_kernel`, one program per request: the accept test of every draft at once (equal to
  the candidate on greedy and one-hot rows, u * q(x) < p(x) in float64 where q was sampled),
  then the accepted run before the first rejection and the token that ends it.

Divisions are correctly rounded (`div_rn`) and argmax ties go to the lowest id, as in torch, so
the tokens equal the reference's on the same inputs, bit for bit, on a GPU too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024  # vocabulary entries per tile of the race


@triton.jit
def _candidate_kernel(
    probs_ptr,  # [R, V] float32
    q_ptr,  # [R, V] float32, read on residual rows only
    noise_ptr,  # [R, V] float32 Exp(1)
    cu_rows_ptr,  # [B + 1]
    is_greedy_ptr,  # [B] bool
    has_q_ptr,  # [B] bool
    candidate_ptr,  # [R] int64, out
    vocab,
    stride_p,
    stride_q,
    stride_n,
    BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0)
    j = tl.program_id(1)
    start = tl.load(cu_rows_ptr + req)
    num_rows = tl.load(cu_rows_ptr + req + 1) - start
    if j < num_rows:
        row = (start + j).to(tl.int64)
        sampled = tl.load(is_greedy_ptr + req) == 0
        residual_row = (tl.load(has_q_ptr + req) != 0) & (j < num_rows - 1) & sampled
        # Greedy rows divide by 1 (noise not loaded): div_rn(p, 1) == p, the plain argmax. Loads
        # are masked by bounds (offs < limit): a block mask and-ed with a scalar flag is not
        # a mask to the interpreter.
        noise_end = tl.where(sampled, vocab, 0)
        q_end = tl.where(residual_row, vocab, 0)
        best_p = float("-inf")
        best_r = float("-inf")
        max_r = 0.0
        arg_p = 0
        arg_r = 0
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            mask = offs < vocab
            p = tl.load(probs_ptr + row * stride_p + offs, mask=mask, other=float("-inf"))
            e = tl.load(noise_ptr + row * stride_n + offs, mask=offs < noise_end, other=1.0)
            score = tl.math.div_rn(p, e)
            tile_best = tl.max(score, axis=0)
            better = tile_best > best_p  # strictly: ties keep the lowest id, as torch.argmax
            arg_p = tl.where(better, v0 + tl.argmax(score, axis=0), arg_p)
            best_p = tl.maximum(tile_best, best_p)
            q = tl.load(q_ptr + row * stride_q + offs, mask=offs < q_end, other=0.0)
            residual = tl.where(mask, tl.maximum(p - q, 0.0), 0.0)
            max_r = tl.maximum(max_r, tl.max(residual, axis=0))
            score = tl.where(mask, tl.math.div_rn(residual, e), float("-inf"))
            tile_best = tl.max(score, axis=0)
            better = tile_best > best_r
            arg_r = tl.where(better, v0 + tl.argmax(score, axis=0), arg_r)
            best_r = tl.maximum(tile_best, best_r)
        use_residual = residual_row & (max_r > 0.0)
        tl.store(candidate_ptr + row, tl.where(use_residual, arg_r, arg_p).to(tl.int64))


@triton.jit
def _accept_kernel(
    probs_ptr,  # [R, V] float32
    q_ptr,  # [R, V] float32
    draft_ids_ptr,  # [R] int64
    candidate_ptr,  # [R] int64
    uniforms_ptr,  # [R] float32
    cu_rows_ptr,  # [B + 1]
    is_greedy_ptr,  # [B] bool
    has_q_ptr,  # [B] bool
    tokens_ptr,  # [B, max_rows] int64 contiguous, out
    num_accepted_ptr,  # [B] int64, out
    stride_p,
    stride_q,
    max_rows,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(cu_rows_ptr + req)
    num_drafts = tl.load(cu_rows_ptr + req + 1) - start - 1
    q_test = (tl.load(has_q_ptr + req) != 0) & (tl.load(is_greedy_ptr + req) == 0)
    offs = tl.arange(0, BLOCK_D)
    is_draft = offs < num_drafts
    is_tested = offs < tl.where(q_test, num_drafts, 0)  # drafts with a ratio test
    rows = (start + offs).to(tl.int64)
    drafts = tl.load(draft_ids_ptr + rows, mask=is_draft, other=0)
    candidates = tl.load(candidate_ptr + rows, mask=offs <= num_drafts, other=-1)
    u = tl.load(uniforms_ptr + rows, mask=is_tested, other=1.0).to(tl.float64)
    p_x = tl.load(probs_ptr + rows * stride_p + drafts, mask=is_tested, other=0.0)
    q_x = tl.load(q_ptr + rows * stride_q + drafts, mask=is_tested, other=0.0)
    ratio_test = u * q_x.to(tl.float64) < p_x.to(tl.float64)
    accept = tl.where(q_test, ratio_test, candidates == drafts) & is_draft
    num_accepted = tl.min(tl.where(accept, BLOCK_D, offs), axis=0)  # the first rejected row
    tokens = tl.where(offs < num_accepted, drafts, candidates)
    tokens = tl.where(offs <= num_accepted, tokens, -1)
    tl.store(tokens_ptr + req * max_rows + offs, tokens, mask=offs < max_rows)
    tl.store(num_accepted_ptr + req, num_accepted.to(tl.int64))


def rejection_verify(
    probs: torch.Tensor,  # [R, V] float32; greedy requests' rows: any scores (argmax only)
    draft_ids: torch.Tensor,  # [R] int64, the draft after each row (last rows: any)
    draft_probs: torch.Tensor | None,  # [R, V] float32 q; None when no request has q
    cu_rows: torch.Tensor,  # [B + 1] int, row offsets of the requests
    is_greedy: torch.Tensor,  # [B] bool
    has_q: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor,  # [R] float32 U(0, 1)
    noise: torch.Tensor,  # [R, V] float32 Exp(1)
    max_rows: int,  # the largest 1 + drafts of the batch
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [B, max_rows] (-1 past the emitted), [B]
    num_rows, vocab = probs.shape
    num_reqs = cu_rows.numel() - 1
    if probs.dtype != torch.float32 or noise.shape != probs.shape or noise.dtype != probs.dtype:
        raise ValueError(
            f"probs and noise must be float32 [R, V] alike, got {probs.dtype} "
            f"{tuple(probs.shape)} and {noise.dtype} {tuple(noise.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != probs.shape:
        raise ValueError(
            f"draft_probs must be [R, V] = {tuple(probs.shape)}, got {tuple(draft_probs.shape)}"
        )
    if draft_ids.shape != (num_rows,) or uniforms.shape != (num_rows,):
        raise ValueError(
            f"draft_ids and uniforms must be [R] = [{num_rows}], got {tuple(draft_ids.shape)}, "
            f"{tuple(uniforms.shape)}"
        )
    if is_greedy.shape != (num_reqs,) or has_q.shape != (num_reqs,) or max_rows < 1:
        raise ValueError(
            f"is_greedy and has_q must be [B] = [{num_reqs}] and max_rows >= 1, got "
            f"{tuple(is_greedy.shape)}, {tuple(has_q.shape)}, {max_rows}"
        )
    if any(t.stride(-1) != 1 for t in (probs, noise, draft_ids, uniforms)):
        raise ValueError("probs and noise rows, draft_ids and uniforms must be contiguous")
    q = probs if draft_probs is None else draft_probs  # never read without has_q rows
    if q.stride(1) != 1:
        raise ValueError("draft_probs rows must be contiguous")
    candidate = torch.empty(num_rows, dtype=torch.int64, device=probs.device)
    tokens = torch.empty(num_reqs, max_rows, dtype=torch.int64, device=probs.device)
    num_accepted = torch.empty(num_reqs, dtype=torch.int64, device=probs.device)
    if num_reqs == 0:
        return tokens, num_accepted
    _candidate_kernel[(num_reqs, max_rows)](
        probs,
        q,
        noise,
        cu_rows,
        is_greedy,
        has_q,
        candidate,
        vocab,
        probs.stride(0),
        q.stride(0),
        noise.stride(0),
        BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)),
    )
    _accept_kernel[(num_reqs,)](
        probs,
        q,
        draft_ids,
        candidate,
        uniforms,
        cu_rows,
        is_greedy,
        has_q,
        tokens,
        num_accepted,
        probs.stride(0),
        q.stride(0),
        max_rows,
        BLOCK_D=triton.next_power_of_2(max_rows),
    )
    return tokens, num_accepted
