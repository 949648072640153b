"""Oracles the tests hold the engine's batched sampling and verification to: plain sampling
over a batch, and speculative verification written as the walk it is (one request at a time,
random numbers drawn as it goes), as engine/rejection.py's docstring describes it."""

from __future__ import annotations

import torch

from engine.rejection import VerifyResult, VerifyRow, verify_greedy
from engine.sampler import SamplingBatch, exponential_noise, race_noise


def exponentialrace(
    probs: torch.Tensor,  # [M, V]
    generators: list[torch.Generator | None],  # [M] a row's own (seeded) generator, or None
    generator: torch.Generator | None,  # shared by the rows without their own
) -> torch.Tensor:  # [M] int64
    """One categorical draw per row: argmax p / E with E ~ Exp(1) (noise: race_noise)."""
    noise = race_noise(generators, probs.shape[1], generator, probs.device)
    return (probs / noise).argmax(dim=-1)


def sample(
    processed: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None
) -> torch.Tensor:  # [M] int64
    greedy_tokens = processed.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_tokens
    generators = [r.generator for r in batch.requests]
    random_tokens = exponentialrace(processed.softmax(dim=-1), generators, generator)
    is_greedy = torch.tensor([r.params.is_greedy for r in batch.requests], device=processed.device)
    return torch.where(is_greedy, greedy_tokens, random_tokens)


def race(weights: torch.Tensor, noise: torch.Tensor) -> int:
    """A draw from weights / weights.sum() given E ~ Exp(1) noise of the same shape."""
    return int((weights / noise).argmax())


def verify(
    processed: torch.Tensor,  # [R, V] processed logits (-inf = excluded) for every row
    rows: list[VerifyRow],
    generator: torch.Generator | None,  # the engine's, for unseeded requests
) -> list[VerifyResult]:
    vocab = processed.shape[1]
    argmax = processed.argmax(dim=-1).tolist()  # [R]
    probs, drawn = None, {}
    if not all(r.greedy for r in rows):
        probs = processed.softmax(dim=-1)  # [R, V]; greedy rows unused
        # Sampled rows without drafts: plain sampling, one batched race (the sampler's own).
        plain = [i for i, r in enumerate(rows) if not r.greedy and not r.drafts]
        if plain:
            idx = torch.tensor([rows[i].start for i in plain])
            tokens = exponentialrace(probs[idx], [rows[i].generator for i in plain], generator)
            drawn = dict(zip(plain, tokens.tolist(), strict=True))
    results: list[VerifyResult] = []
    for i, row in enumerate(rows):
        if row.greedy:
            results.append(verify_greedy(row, argmax))
        elif i in drawn:
            results.append(VerifyResult([drawn[i]], 0))
        else:
            results.append(_verify_sampled(row, probs, vocab, generator))
    return results


def _verify_sampled(
    row: VerifyRow, probs: torch.Tensor, vocab: int, generator: torch.Generator | None
) -> VerifyResult:
    gen = row.generator if row.generator is not None else generator
    if row.draft_probs is None:
        return _verify_one_hot(row, probs, vocab, gen)
    d = len(row.drafts)
    uniforms = torch.rand(d, generator=gen).tolist() if d else []
    tokens = []
    for j, draft in enumerate(row.drafts):
        p = probs[row.start + j]
        if uniforms[j] * float(row.draft_probs[j, draft]) < float(p[draft]):  # u < p / q
            tokens.append(draft)
            continue
        residual = (p - row.draft_probs[j]).clamp_(min=0.0)
        if not float(residual.sum()) > 0.0:  # p == q up to rounding: fall back to p itself
            residual = p
        noise = exponential_noise(vocab, generator=gen)
        tokens.append(race(residual, noise))
        return VerifyResult(tokens, j)
    noise = exponential_noise(vocab, generator=gen)
    tokens.append(race(probs[row.start + d], noise))
    return VerifyResult(tokens, d)


def _verify_one_hot(
    row: VerifyRow, probs: torch.Tensor, vocab: int, gen: torch.Generator | None
) -> VerifyResult:
    """Deterministic drafts: sample each position as plain decoding would, keep going while the
    sample equals the draft. A seeded request draws one vector per emitted token (its tokens do
    not depend on k); a row on the shared generator draws all d + 1 at once, as the batched
    verifier does (it cannot wait to see where the walk stops)."""
    d = len(row.drafts)
    ahead = exponential_noise(d + 1, vocab, generator=gen) if row.generator is None else None
    tokens = []
    for j in range(d + 1):
        noise = exponential_noise(vocab, generator=gen) if ahead is None else ahead[j]
        tokens.append(race(probs[row.start + j], noise))
        if j == len(row.drafts) or tokens[-1] != row.drafts[j]:
            break
    return VerifyResult(tokens, len(tokens) - 1)
