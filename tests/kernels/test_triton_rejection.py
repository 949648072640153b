"""Fused rejection-sampling verification (kernels/triton_rejection.py) against its reference and
against oracles.verify: under TRITON_INTERPRET=1 on CPU in the default run, on CUDA at a
real vocabulary when a GPU is present (`gpu` marker).

oracles.verify draws its random numbers as it walks; `spec_draws` replays the same
generators from copies to hand the batched verifiers exactly the numbers spec used, so the three
must agree token for token. engine.rejection.verify_batched, the engine's verifier (draws up front,
one batched call), must equal it too, generators' states included."""

from __future__ import annotations

from dataclasses import replace

import oracles
import pytest
import torch

from engine import rejection
from engine.rejection import VerifyRow
from engine.sampler import exponential_noise
from kernels import reference, triton_rejection
from kernels.triton_rejection import rejection_verify  # TRITON_INTERPRET: conftest

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ("greedy", "plain", "q", "one_hot")  # plain: sampled without drafts


def make_batch(kinds: list[str], num_drafts: list[int], vocab: int, gen: torch.Generator):
    """Processed logits for every row (some tokens excluded) and a VerifyRow per request. q is
    the target blurred (drafts sampled from it), so p / q lies near 1 and the uniforms matter;
    one-hot drafts mostly copy the target's argmax, so long runs of accepts happen."""
    rows, blocks, start = [], [], 0
    for kind, d in zip(kinds, num_drafts, strict=True):
        d = 0 if kind == "plain" else d
        logits = torch.randn(d + 1, vocab, generator=gen) * 4
        logits[:, torch.randperm(vocab, generator=gen)[: vocab // 4]] = float("-inf")
        drafts = torch.randint(0, vocab, (d,), generator=gen)
        likely = torch.rand(d, generator=gen) < 0.75
        drafts = torch.where(likely, logits[:d].argmax(-1), drafts).tolist()
        q = None
        if kind == "q" and d:
            blur = torch.randn(d, vocab, generator=gen)
            q = (logits[:d].clamp(min=-20) + blur).softmax(-1)  # excluded tokens: rarely drafted
            if start % 2:  # q above p everywhere on the first row: its residual is empty
                q[0] = logits[0].softmax(-1) * 3
            drafts = torch.multinomial(q, 1, generator=gen)[:, 0].tolist()
        own = torch.Generator().manual_seed(start) if start % 3 == 0 else None
        rows.append(VerifyRow(start, drafts, q, kind == "greedy", own))
        blocks.append(logits)
        start += d + 1
    return torch.cat(blocks), rows


def copy_of(generator: torch.Generator | None) -> torch.Generator | None:
    return None if generator is None else torch.Generator().set_state(generator.get_state())


def spec_draws(rows: list[VerifyRow], results, generator: torch.Generator, vocab: int):
    """The uniforms [R] and exponential noise [R, V] that oracles.verify drew, replayed in
    its order from copies of the generators as they were before it ran. Rows it drew nothing
    for get numbers from elsewhere: the batched verifiers must not depend on them."""
    num_rows = sum(r.num_rows for r in rows)
    junk = torch.Generator().manual_seed(99)
    uniforms = torch.rand(num_rows, generator=junk)
    noise = torch.empty(num_rows, vocab).exponential_(generator=junk)
    engine = copy_of(generator)
    own = [copy_of(r.generator) for r in rows]
    plain = [i for i, r in enumerate(rows) if not r.greedy and not r.drafts]
    unseeded = [i for i in plain if own[i] is None]
    if unseeded and not all(r.greedy for r in rows):  # exponential_race: batched, then seeded
        batch = exponential_noise(len(unseeded), vocab, generator=engine)
        for i, vector in zip(unseeded, batch, strict=True):
            noise[rows[i].start] = vector
    for i in plain:
        if own[i] is not None:
            noise[rows[i].start] = exponential_noise(vocab, generator=own[i])
    for i, (row, result) in enumerate(zip(rows, results, strict=True)):
        if row.greedy or not row.drafts:
            continue
        gen = own[i] or engine
        d, start = len(row.drafts), row.start
        if row.draft_probs is not None:  # d uniforms, then one vector for wherever it stops
            uniforms[start : start + d] = torch.rand(d, generator=gen)
            noise[start : start + d + 1] = exponential_noise(vocab, generator=gen)
        elif own[i] is None:  # the shared generator: d + 1 vectors at once
            noise[start : start + d + 1] = exponential_noise(d + 1, vocab, generator=gen)
        else:  # its own: one vector per emitted token
            for j in range(result.num_accepted + 1):
                noise[start + j] = exponential_noise(vocab, generator=gen)
    return uniforms, noise


def batched_inputs(processed: torch.Tensor, rows: list[VerifyRow]):
    """spec's rows as the batched verifiers take them (probs as spec computes them)."""
    draft_ids = torch.zeros(processed.shape[0], dtype=torch.int64)
    draft_probs = torch.zeros_like(processed)
    for r in rows:
        draft_ids[r.start : r.start + len(r.drafts)] = torch.tensor(r.drafts, dtype=torch.int64)
        if r.draft_probs is not None:
            draft_probs[r.start : r.start + len(r.drafts)] = r.draft_probs
    starts = [r.start for r in rows] + [processed.shape[0]]
    return dict(
        probs=processed.softmax(-1),
        draft_ids=draft_ids,
        draft_probs=draft_probs,
        cu_rows=torch.tensor(starts),
        is_greedy=torch.tensor([r.greedy for r in rows]),
        has_q=torch.tensor([r.draft_probs is not None for r in rows]),
        max_rows=max(r.num_rows for r in rows),
    )


def on_device(inputs: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def as_lists(tokens: torch.Tensor, num_accepted: torch.Tensor):
    return [
        ([t for t in row if t >= 0], n)
        for row, n in zip(tokens.tolist(), num_accepted.tolist(), strict=True)
    ]


def spec_and_inputs(seed: int, num_reqs: int, vocab: int, max_drafts: int = 4):
    gen = torch.Generator().manual_seed(seed)
    kinds = [KINDS[int(i)] for i in torch.randint(0, 4, (num_reqs,), generator=gen)]
    num_drafts = torch.randint(0, max_drafts + 1, (num_reqs,), generator=gen).tolist()
    processed, rows = make_batch(kinds, num_drafts, vocab, gen)
    engine = torch.Generator().manual_seed(seed + 1)
    before = copy_of(engine)
    own_before = [copy_of(r.generator) for r in rows]
    results = oracles.verify(processed, rows, engine)
    for r, g in zip(rows, own_before, strict=True):  # give spec_draws the generators as before
        r.generator = g
    uniforms, noise = spec_draws(rows, results, before, vocab)
    inputs = batched_inputs(processed, rows) | dict(uniforms=uniforms, noise=noise)
    return [(r.tokens, r.num_accepted) for r in results], inputs


@pytest.mark.parametrize("seed", range(6))
def test_reference_and_kernel_equal_spec(seed, monkeypatch):
    """Mixed batches of greedy, plain sampled, q-sampled and one-hot drafts; vocabulary 300 in
    tiles of 64 (argmax across tiles, a ragged last tile)."""
    monkeypatch.setattr(triton_rejection, "BLOCK_V", 64)
    want, inputs = spec_and_inputs(seed, num_reqs=12, vocab=300)
    assert as_lists(*reference.rejection_verify(**inputs)) == want
    assert as_lists(*rejection_verify(**on_device(inputs))) == want


def run_both(seed: int, num_reqs: int, vocab: int, kernel):
    """oracles.verify (the oracle) and verify_batched from equal generators: each one's
    results and its generators' states afterwards."""
    gen = torch.Generator().manual_seed(seed)
    kinds = [KINDS[int(i)] for i in torch.randint(0, 4, (num_reqs,), generator=gen)]
    num_drafts = torch.randint(0, 5, (num_reqs,), generator=gen).tolist()
    processed, rows = make_batch(kinds, num_drafts, vocab, gen)
    runs = []
    for batched in (False, True):
        engine = torch.Generator().manual_seed(seed + 1)
        own = [copy_of(r.generator) for r in rows]
        mine = [replace(r, generator=g) for r, g in zip(rows, own, strict=True)]
        if batched:
            pending = rejection.verify_batched(processed, mine, engine, kernel)
            tokens, accepted = pending.tokens.tolist(), pending.num_accepted.tolist()
            results = pending.results(tokens, accepted)
        else:
            results = oracles.verify(processed, mine, engine)
        states = [g.get_state() for g in [engine, *own] if g is not None]
        runs.append(([(r.tokens, r.num_accepted) for r in results], states))
    return runs


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_verify_batched_equals_the_walk(seed, kernel, monkeypatch):
    """What the engine runs (draws up front, one batched call, seeded one-hot generators set
    back afterwards) emits the oracle's tokens and leaves every generator as the oracle does."""
    monkeypatch.setattr(triton_rejection, "BLOCK_V", 64)
    fn = reference.rejection_verify if kernel == "reference" else rejection_verify
    (want, want_states), (got, got_states) = run_both(seed, num_reqs=12, vocab=300, kernel=fn)
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_states, want_states, strict=True))


def test_verify_batched_without_rewinds_is_caught(monkeypatch):
    """The same test, with the rewinds dropped: a seeded one-hot request's generator ends past
    what its walk consumed (its next tokens would depend on how many drafts it had)."""
    real = rejection.draw

    def no_rewinds(*args):
        draws = real(*args)
        return replace(draws, rewinds=[])

    monkeypatch.setattr(rejection, "draw", no_rewinds)
    differs = 0
    for seed in range(4):
        (_, want_states), (_, got_states) = run_both(seed, 12, 300, reference.rejection_verify)
        differs += sum(not torch.equal(a, b) for a, b in zip(got_states, want_states, strict=True))
    assert differs > 0


def test_cases_accept_reject_and_fall_back():
    """The seeds above reach what they claim: accepted runs of every length, rejections on
    each kind of row, and the empty-residual fallback."""
    seen = set()
    for seed in range(6):
        want, inputs = spec_and_inputs(seed, num_reqs=12, vocab=300)
        cu, probs, q = inputs["cu_rows"].tolist(), inputs["probs"], inputs["draft_probs"]
        for b, (_, accepted) in enumerate(want):
            d = cu[b + 1] - cu[b] - 1
            kind = "greedy" if inputs["is_greedy"][b] else "q" if inputs["has_q"][b] else "hot"
            seen.add((kind, "all" if accepted == d else "rejected") if d else ("plain", "-"))
            seen.add(("accepted", accepted))
            if kind == "q" and d and not accepted and bool((q[cu[b]] >= probs[cu[b]]).all()):
                seen.add("empty residual")
    assert {("accepted", n) for n in range(5)} <= seen
    for kind in ("greedy", "q", "hot"):
        assert {(kind, "all"), (kind, "rejected")} <= seen, kind
    assert {("plain", "-"), "empty residual"} <= seen


def test_draws_decide_the_outcome():
    """The equality above is not vacuous: other uniforms, or other noise, change verdicts."""
    changed = {"uniforms": 0, "noise": 0}
    for seed in range(6):
        want, inputs = spec_and_inputs(seed, num_reqs=12, vocab=300)
        for name, other in [
            ("uniforms", 1 - inputs["uniforms"]),
            ("noise", inputs["noise"].roll(1, 1)),
        ]:
            got = as_lists(*rejection_verify(**on_device(inputs | {name: other})))
            changed[name] += sum(g != w for g, w in zip(got, want, strict=True))
    assert min(changed.values()) >= 3, changed


def test_ties_go_to_the_lowest_id_across_tiles(monkeypatch):
    monkeypatch.setattr(triton_rejection, "BLOCK_V", 16)
    vocab = 50
    logits = torch.full((2, vocab), -1.0)
    logits[:, [5, 21, 40]] = 3.0  # equal maxima in three tiles
    inputs = dict(
        probs=logits,
        draft_ids=torch.tensor([21, 0]),
        draft_probs=None,
        cu_rows=torch.tensor([0, 2]),
        is_greedy=torch.tensor([True]),
        has_q=torch.tensor([False]),
        uniforms=torch.rand(2),
        noise=torch.ones(2, vocab),
        max_rows=2,
    )
    want = [([5], 0)]
    assert as_lists(*reference.rejection_verify(**inputs)) == want
    assert as_lists(*rejection_verify(**on_device(inputs))) == want


def test_bad_shapes_name_the_argument():
    probs = torch.rand(3, 10)
    good = dict(
        probs=probs,
        draft_ids=torch.zeros(3, dtype=torch.int64),
        draft_probs=None,
        cu_rows=torch.tensor([0, 3]),
        is_greedy=torch.tensor([False]),
        has_q=torch.tensor([False]),
        uniforms=torch.rand(3),
        noise=torch.rand(3, 10),
        max_rows=3,
    )
    for change, name in [
        (dict(noise=torch.rand(3, 9)), "noise"),
        (dict(probs=probs.double(), noise=probs.double()), "float32"),
        (dict(draft_probs=torch.rand(2, 10)), "draft_probs"),
        (dict(uniforms=torch.rand(2)), "uniforms"),
        (dict(has_q=torch.tensor([False, True])), "has_q"),
    ]:
        with pytest.raises(ValueError, match=name):
            rejection_verify(**(good | change))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_real_vocabulary():
    """Qwen2.5's vocabulary, a verify step of 64 requests with up to 4 drafts, on CUDA."""
    want, inputs = spec_and_inputs(11, num_reqs=64, vocab=151_936)
    assert as_lists(*rejection_verify(**on_device(inputs))) == want
