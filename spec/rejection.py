"""Lossless verification of draft tokens (speculative rejection sampling).

For each request the target model scored its last token plus d drafts: d + 1 rows of logits,
already through the same `process_logits` pipeline the plain sampler uses (so temperature, top-k,
top-p, min-p, penalties, logit bias and min_tokens bans all shape p exactly as they would without
speculation). Walking the drafts in order:

- greedy request: draft j is accepted iff it is the argmax of p_j; the first mismatch emits the
  argmax instead; if all d are accepted the argmax of the last row is the bonus token;
- sampled request: draft x_j, proposed with probability q_j(x_j), is accepted with probability
  min(1, p_j(x_j) / q_j(x_j)); on rejection the emitted token is drawn from the normalised residual
  max(p_j - q_j, 0); after d acceptances the bonus is drawn from p_d. Each emitted token is then
  distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023);
- sampled request whose proposer does not sample (n-gram lookup, greedy draft model: q one-hot):
  at each position draw the token y_j that plain sampling would draw from p_j, and accept the
  draft iff y_j == x_j; the first mismatch emits y_j. That accepts with probability p_j(x_j) and
  on rejection emits a draw from p_j without x_j, the one-hot residual, so it is the same
  lossless test; and since it consumes exactly the random numbers plain sampling would, one
  exponential vector per emitted token, a seeded request emits the very tokens it would emit
  without speculation, whatever k and whatever its neighbours.

With d = 0 this is plain sampling, so every request goes through the same function; those rows
share the sampler's batched `exponential_race`.

Random draws (the exponential race: argmax w / E with E ~ Exp(1) is a draw from w / sum w): a
sampled q costs d uniforms then one exponential vector; one-hot drafts one exponential vector
per emitted token. A seeded request draws from its own generator, so its tokens do not depend on
its neighbours in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampler import exponential_race


@dataclass(slots=True)
class VerifyRow:
    """One request's share of the verification batch."""

    start: int  # first of its d + 1 rows in the processed logits
    drafts: list[int]  # d draft tokens
    draft_probs: torch.Tensor | None  # [d, V] q, or None for a deterministic (one-hot) proposer
    greedy: bool
    generator: torch.Generator | None  # the request's own (seeded) generator, if any

    @property
    def num_rows(self) -> int:
        return len(self.drafts) + 1


@dataclass(slots=True)
class VerifyResult:
    tokens: list[int]  # accepted drafts, then the recovered or bonus token: 1..d+1 tokens
    num_accepted: int


def _race(weights: torch.Tensor, noise: torch.Tensor) -> int:
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
            tokens = exponential_race(probs[idx], [rows[i].generator for i in plain], generator)
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


def verify_greedy(row: VerifyRow, argmax: list[int]) -> VerifyResult:
    tokens = []
    for j, draft in enumerate(row.drafts):
        target = argmax[row.start + j]
        tokens.append(target)
        if draft != target:
            return VerifyResult(tokens, j)
    tokens.append(argmax[row.start + len(row.drafts)])
    return VerifyResult(tokens, len(row.drafts))


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
        noise = torch.empty(vocab).exponential_(generator=gen)
        tokens.append(_race(residual, noise))
        return VerifyResult(tokens, j)
    noise = torch.empty(vocab).exponential_(generator=gen)
    tokens.append(_race(probs[row.start + d], noise))
    return VerifyResult(tokens, d)


def _verify_one_hot(
    row: VerifyRow, probs: torch.Tensor, vocab: int, gen: torch.Generator | None
) -> VerifyResult:
    """Deterministic drafts: sample each position as plain decoding would, keep going while the
    sample equals the draft."""
    tokens = []
    for j in range(len(row.drafts) + 1):
        noise = torch.empty(vocab).exponential_(generator=gen)
        tokens.append(_race(probs[row.start + j], noise))
        if j == len(row.drafts) or tokens[-1] != row.drafts[j]:
            break
    return VerifyResult(tokens, len(tokens) - 1)
