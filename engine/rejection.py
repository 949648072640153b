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

With d = 0 this is plain sampling, so every request goes through the same function.

Random draws (the exponential race: argmax w / E with E ~ Exp(1) is a draw from w / sum w): a
sampled q costs d uniforms then one exponential vector; one-hot drafts one exponential vector
per emitted token (d + 1 up front on the shared generator). A seeded request draws from its own
generator, so its tokens do not depend on its neighbours in the batch.

`verify_batched` is what the engine runs, on the logits' device: the draws taken up front
(`draw`), every request verified in one batched call (kernels.reference.rejection_verify, or
the fused Triton kernel on CUDA), and nothing read back until the caller's one copy to the host
(`PendingVerify.results`). The tests hold it equal, token for token and generator state for
generator state, to an oracle that walks the drafts as written above, one request at a time,
drawing as it goes (tests/oracles.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.device import host_tensor, to_device
from engine.sampler import exponential_noise, race_noise
from kernels import reference


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

    @property
    def end(self) -> int:
        return self.start + len(self.drafts) + 1


@dataclass(slots=True)
class VerifyResult:
    tokens: list[int]  # accepted drafts, then the recovered or bonus token: 1..d+1 tokens
    num_accepted: int


def verify_greedy(row: VerifyRow, argmax: list[int]) -> VerifyResult:
    tokens = []
    for j, draft in enumerate(row.drafts):
        target = argmax[row.start + j]
        tokens.append(target)
        if draft != target:
            return VerifyResult(tokens, j)
    tokens.append(argmax[row.start + len(row.drafts)])
    return VerifyResult(tokens, len(row.drafts))


@dataclass(slots=True)
class Draws:
    """The random numbers `verify` would draw for a batch, drawn before any verdict."""

    uniforms: torch.Tensor  # [R] float32 U(0, 1): the accept tests of drafts sampled from q
    noise: torch.Tensor  # [R, V] float32 Exp(1): the race of each sampled row (1 elsewhere)
    # Seeded one-hot requests draw a vector for every row, one per row as `verify` does, and
    # keep their generator's state after each: (request's index, generator, [d + 1 states]).
    rewinds: list[tuple[int, torch.Generator, list[torch.Tensor]]]


def draw(
    rows: list[VerifyRow],
    vocab: int,
    device: torch.device,
    generator: torch.Generator | None,  # the shared one, on `device`
) -> Draws:
    """`verify`'s draws in `verify`'s order: the plain rows' race (unseeded rows in one batch,
    then each seeded row), then request by request: d uniforms and one vector for whichever row
    a q-sampled walk stops at (every row of it gets that vector), d + 1 vectors for a one-hot
    walk. A seeded one-hot walk consumes only the vectors of the tokens it emits: `rewinds`
    sets its generator back once the verdict is known. Seeded rows' generators are on `device`."""
    num_rows = sum(r.num_rows for r in rows)
    uniforms = torch.zeros(num_rows, device=device)
    noise = torch.empty(num_rows, vocab, device=device)
    greedy = [j for r in rows if r.greedy for j in range(r.start, r.end)]
    if greedy:
        # index_fill_ takes the value as a scalar: `noise[idx] = 1.0` would copy a host
        # scalar tensor to the device, which waits for it.
        noise.index_fill_(0, to_device(host_tensor(greedy), device), 1.0)
    plain = [r for r in rows if not r.greedy and not r.drafts]
    if plain:
        starts = to_device(host_tensor([r.start for r in plain]), device)
        noise[starts] = race_noise([r.generator for r in plain], vocab, generator, device)
    rewinds = []
    for i, r in enumerate(rows):
        if r.greedy or not r.drafts:
            continue
        gen, d, start = r.generator or generator, len(r.drafts), r.start
        if r.draft_probs is not None:
            uniforms[start : start + d] = torch.rand(d, generator=gen, device=device)
            noise[start : start + d + 1] = exponential_noise(vocab, generator=gen, device=device)
        elif r.generator is None:
            noise[start : start + d + 1] = exponential_noise(
                d + 1, vocab, generator=gen, device=device
            )
        else:
            states = []
            for j in range(d + 1):
                noise[start + j] = exponential_noise(vocab, generator=gen, device=device)
                states.append(gen.get_state())
            rewinds.append((i, gen, states))
    return Draws(uniforms, noise, rewinds)


# kernels.reference.rejection_verify's signature: (probs, draft_ids, draft_probs, cu_rows,
# is_greedy, has_q, uniforms, noise, max_rows) -> (tokens [B, max_rows], num_accepted [B])
VerifyKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class PendingVerify:
    """A batch's verdicts, still on the device until the caller copies them to the host."""

    tokens: torch.Tensor  # [B, max_rows] int64: each request's emitted tokens, then -1
    num_accepted: torch.Tensor  # [B] int64
    rewinds: list[tuple[int, torch.Generator, list[torch.Tensor]]]

    def results(self, tokens: list[list[int]], num_accepted: list[int]) -> list[VerifyResult]:
        """The verdicts from the host copies of `tokens` and `num_accepted`; seeded one-hot
        generators set back to what their walks consumed."""
        for i, gen, states in self.rewinds:
            gen.set_state(states[num_accepted[i]])
        return [VerifyResult(row[: n + 1], n) for row, n in zip(tokens, num_accepted, strict=True)]


def verify_batched(
    processed: torch.Tensor,  # [R, V] float32 processed logits, rows of `rows` in order
    rows: list[VerifyRow],  # starts 0, 1 + d_0, ...: consecutive
    generator: torch.Generator | None,  # the shared one, on processed's device
    kernel: VerifyKernel = reference.rejection_verify,
) -> PendingVerify:
    """`verify` on processed's device without waiting for it: the draws, then one kernel call."""
    device, vocab = processed.device, processed.shape[1]
    starts = [r.start for r in rows]
    if not rows or starts != [0, *(r.end for r in rows[:-1])]:
        raise ValueError(f"rows must be consecutive from 0, got starts {starts}")
    draws = draw(rows, vocab, device, generator)
    greedy_rows = [r.greedy for r in rows for _ in range(r.num_rows)]
    if all(greedy_rows):
        probs = processed  # argmax only
    elif not any(greedy_rows):
        probs = processed.softmax(dim=-1)
    else:
        # Greedy rows keep their logits (their argmax, untouched by softmax rounding).
        greedy = to_device(torch.tensor(greedy_rows), device)
        probs = torch.where(greedy[:, None], processed, processed.softmax(dim=-1))
    draft_list, draft_probs = [], None
    for r in rows:
        draft_list += [*r.drafts, 0]
        if r.draft_probs is not None:
            if draft_probs is None:
                draft_probs = torch.zeros_like(probs)
            draft_probs[r.start : r.start + len(r.drafts)] = to_device(r.draft_probs, device)
    draft_ids, cu_rows, is_greedy, has_q = to_device(
        (
            host_tensor(draft_list),
            host_tensor([*starts, rows[-1].end]),
            torch.tensor([r.greedy for r in rows]),
            torch.tensor([r.draft_probs is not None for r in rows]),
        ),
        device,
    )
    tokens, num_accepted = kernel(
        probs=probs.contiguous(),
        draft_ids=draft_ids,
        draft_probs=draft_probs,
        cu_rows=cu_rows,
        is_greedy=is_greedy,
        has_q=has_q,
        uniforms=draws.uniforms,
        noise=draws.noise,
        max_rows=max(r.num_rows for r in rows),
    )
    return PendingVerify(tokens, num_accepted, draws.rewinds)
