"""Sampler: each logits-processing parameter on synthetic logits, the sampled distribution
(chi-square against an independent float64 reference), and seeded reproducibility."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracles import sample
from scipy.stats import chisquare
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from engine import LLM, SamplingParams
from engine import sampler as sampler_mod
from engine.request import Request
from engine.sampler import SamplingBatch, TopLogprobs, process_logits

V = 10  # synthetic vocabulary
EOS = 9
NEG_INF = float("-inf")
PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]  # top-p / min-p table, before PERM
PERM = [3, 0, 4, 1, 2]  # token PERM[i] gets PROBS[i]: sorting must not be assumed


def make_request(params: SamplingParams, prompt=(1, 2, 3), output=(), rid="r") -> Request:
    r = Request(rid, list(prompt), params, {EOS}, max_model_len=1024)
    for t in output:
        r.append_token(t)
    return r


def run(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """[M, V] raw logits -> [M, V] processed logits."""
    return process_logits(logits, SamplingBatch.from_requests(requests, logits.shape[1]))


def process_one(row, params: SamplingParams, **kw) -> torch.Tensor:
    return run(torch.as_tensor(row, dtype=torch.float32)[None], [make_request(params, **kw)])[0]


def table_logits() -> torch.Tensor:
    logits = torch.full((len(PROBS),), 0.0)
    logits[PERM] = torch.tensor(PROBS).log()
    return logits


def kept(processed: torch.Tensor) -> set[int]:
    return set(torch.isfinite(processed).nonzero()[:, 0].tolist())


def np_softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z[np.isfinite(z)].max())
    return e / e.sum()


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Independent float64 reference of HF's warper chain: temperature, top-k, top-p, min-p."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if top_k:
        z[order[top_k:]] = -np.inf
    p = np_softmax(z)
    cum_before = np.cumsum(p[order]) - p[order]
    z[order[1:][cum_before[1:] >= top_p]] = -np.inf  # smallest prefix reaching top_p
    p = np_softmax(z)
    z[p < min_p * p.max()] = -np.inf
    return np_softmax(z)


# ---- greedy and temperature ----------------------------------------------------------------
def test_greedy_is_exact_argmax_also_in_a_mixed_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, V, generator=g) * 3
    greedy = [make_request(SamplingParams(temperature=0)) for _ in range(32)]
    batch = SamplingBatch.from_requests(greedy, V)
    assert batch.all_greedy
    assert torch.equal(sample(process_logits(logits, batch), batch, g), logits.argmax(-1))

    mixed = [
        make_request(SamplingParams(temperature=0 if i % 2 else 1.5, top_k=3, top_p=0.5))
        for i in range(32)
    ]
    batch = SamplingBatch.from_requests(mixed, V)
    tokens = sample(process_logits(logits, batch), batch, g)
    assert torch.equal(tokens[1::2], logits[1::2].argmax(-1))


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 2.0, 10.0])
def test_temperature_scales_logits(temperature):
    logits = torch.linspace(-2.0, 3.0, V)
    out = process_one(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(out, logits / temperature)


def test_temperature_flattens_and_sharpens():
    logits = torch.linspace(-2.0, 3.0, V)

    def entropy(t):
        p = process_one(logits, SamplingParams(temperature=t)).softmax(-1)
        return float(-(p * p.log()).sum())

    entropies = [entropy(t) for t in (0.3, 0.7, 1.0, 1.5, 5.0)]
    assert entropies == sorted(entropies)
    assert entropies[-1] > 0.95 * np.log(V) and entropies[0] < 0.3 * np.log(V)


def test_greedy_rows_are_not_scaled():
    logits = torch.linspace(-2.0, 3.0, V).repeat(2, 1)
    reqs = [
        make_request(SamplingParams(temperature=0)),
        make_request(SamplingParams(temperature=0.5)),
    ]
    out = run(logits, reqs)
    torch.testing.assert_close(out[0], logits[0])
    torch.testing.assert_close(out[1], logits[1] / 0.5)


# ---- top-k, top-p, min-p -------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 5, 9, V])
def test_top_k_keeps_exactly_k(k):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(k))
    out = process_one(logits, SamplingParams(top_k=k))
    assert kept(out) == set(logits.topk(k).indices.tolist())
    torch.testing.assert_close(out[list(kept(out))], logits[list(kept(out))])


def test_top_k_per_row_with_disabled_rows():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    reqs = [make_request(SamplingParams(top_k=k)) for k in (2, 0, -1)]
    out = run(logits, reqs)
    assert kept(out[0]) == set(logits[0].topk(2).indices.tolist())
    assert kept(out[1]) == kept(out[2]) == set(range(V))


def test_top_k_larger_than_vocab_keeps_everything():
    logits = torch.randn(V)
    assert kept(process_one(logits, SamplingParams(top_k=V + 5))) == set(range(V))


@pytest.mark.parametrize(
    "top_p, num_kept",
    [(0.01, 1), (0.45, 1), (0.6, 2), (0.8, 3), (0.9, 4), (0.99, 5), (1.0, 5)],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p, num_kept):
    out = process_one(table_logits(), SamplingParams(top_p=top_p))
    assert kept(out) == set(PERM[:num_kept])
    probs = out.softmax(-1)  # renormalised over the kept set
    mass = sum(PROBS[:num_kept])
    for i in range(num_kept):
        assert float(probs[PERM[i]]) == pytest.approx(PROBS[i] / mass, rel=1e-5)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
def test_top_p_uses_tempered_distribution(temperature):
    logits = table_logits()
    out = process_one(logits, SamplingParams(temperature=temperature, top_p=0.9))
    want = reference_probs(logits.numpy(), temperature, top_p=0.9)
    assert kept(out) == set(np.nonzero(want)[0].tolist())
    np.testing.assert_allclose(out.softmax(-1).numpy(), want, atol=1e-6)


@pytest.mark.parametrize("candidates", [16, 256])
def test_top_p_from_candidates_equals_the_full_sort(candidates, monkeypatch):
    """CPU top-p looks at the most likely tokens first and sorts a row in full only when they
    do not hold top_p: the same tokens dropped as sorting every row, on peaked rows (decided
    from the candidates), flat rows (sorted) and rows with top_p 1, with tokens already
    excluded (top-k)."""
    monkeypatch.setattr(sampler_mod, "TOP_P_CANDIDATES", candidates)
    gen = torch.Generator().manual_seed(candidates)
    vocab, rows = 3000, 48
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0]).repeat(rows // 4)[:, None]
    logits = torch.randn(rows, vocab, generator=gen) * scale
    logits[::5, vocab // 2 :] = float("-inf")
    top_p = torch.tensor([0.5, 0.9, 0.95, 1.0, 0.99, 0.2]).repeat(rows // 6)
    got = sampler_mod.top_p_drop(logits, top_p)
    assert torch.equal(got, sampler_mod._top_p_drop_sorted(logits, top_p))
    probs = logits.softmax(-1).topk(candidates).values.sum(-1)
    decided = (probs >= top_p) & (top_p < 1)
    assert 0 < int(decided.sum()) < int((top_p < 1).sum())  # both ways are taken
    assert not got[top_p == 1.0].any() and got.any()


@pytest.mark.parametrize(
    "min_p, num_kept", [(0.0, 5), (0.09, 5), (0.25, 3), (0.35, 2), (0.5, 1), (1.0, 1)]
)
def test_min_p_threshold_relative_to_max(min_p, num_kept):
    out = process_one(table_logits(), SamplingParams(min_p=min_p))
    assert kept(out) == set(PERM[:num_kept])


def test_min_p_after_temperature():
    logits = table_logits()
    sharp = process_one(logits, SamplingParams(temperature=0.5, min_p=0.25))
    flat = process_one(logits, SamplingParams(temperature=4.0, min_p=0.25))
    for out, t in ((sharp, 0.5), (flat, 4.0)):
        want = reference_probs(logits.numpy(), t, min_p=0.25)
        assert kept(out) == set(np.nonzero(want)[0].tolist())
    assert len(kept(sharp)) < len(kept(flat))


# ---- penalties, bias, min_tokens -----------------------------------------------------------
def test_repetition_penalty_hf_rule_over_prompt_and_output():
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0, 4.0, 1.0, 0.0, -0.5, 3.0, 1.5])
    prompt, output = (0, 1, 1, 6), (3, 4, 4)
    out = process_one(
        logits, SamplingParams(temperature=0, repetition_penalty=2.0), prompt=prompt, output=output
    )
    want = logits.clone()
    want[[0, 4]] /= 2.0  # positive: divided
    want[[1, 3]] *= 2.0  # negative: multiplied; each seen token once, however often seen
    torch.testing.assert_close(out, want)
    hf = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([prompt + output]), logits[None])
    torch.testing.assert_close(out, hf[0])


def test_repetition_penalty_below_one_encourages():
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    out = process_one(logits, SamplingParams(temperature=0, repetition_penalty=0.5), prompt=(0, 1))
    torch.testing.assert_close(out[:3], torch.tensor([4.0, -0.5, 0.5]))


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.3), (1.0, 0.7), (-1.0, -0.5)])
def test_presence_and_frequency_over_output_only(presence, frequency):
    logits = torch.linspace(-1.0, 1.0, V)
    prompt, output = (0, 1, 2, 2), (2, 5, 5, 5, 7)
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    out = process_one(logits, params, prompt=prompt, output=output)
    counts = torch.bincount(torch.tensor(output), minlength=V).float()
    want = logits - frequency * counts - presence * (counts > 0)
    torch.testing.assert_close(out, want)  # prompt-only tokens 0 and 1 untouched
    assert out[0] == logits[0] and out[1] == logits[1]


def test_presence_and_frequency_inactive_without_output():
    logits = torch.linspace(-1.0, 1.0, V)
    params = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0)
    torch.testing.assert_close(process_one(logits, params, prompt=(1, 2, 2)), logits)


def test_penalties_apply_to_greedy():
    logits = torch.tensor([5.0, 4.9] + [0.0] * (V - 2))
    params = SamplingParams(temperature=0, frequency_penalty=0.5)
    req = make_request(params, output=(0,))
    batch = SamplingBatch.from_requests([req], V)
    assert int(sample(process_logits(logits[None], batch), batch, None)[0]) == 1


def test_logit_bias_added_exactly():
    logits = torch.linspace(-1.0, 1.0, V)
    bias = {0: 100.0, 3: -2.5, 7: 0.25}
    out = process_one(logits, SamplingParams(temperature=0, logit_bias=bias))
    want = logits.clone()
    for t, b in bias.items():
        want[t] += b
    torch.testing.assert_close(out, want)
    # String keys (JSON) are accepted; with sampling, +100 makes token 0 certain.
    req = make_request(SamplingParams(temperature=1.0, logit_bias={"0": 100}))
    batch = SamplingBatch.from_requests([req] * 256, V)
    g = torch.Generator().manual_seed(0)
    assert (sample(process_logits(logits.repeat(256, 1), batch), batch, g) == 0).all()


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_bans_eos_and_stop_ids(ignore_eos):
    logits = torch.zeros(V)
    params = SamplingParams(min_tokens=3, stop_token_ids=[4, 6], ignore_eos=ignore_eos)
    banned = {4, 6} if ignore_eos else {4, 6, EOS}
    for n in range(5):
        out = process_one(logits, params, output=(1,) * n)
        want = set(range(V)) - banned if n < 3 else set(range(V))
        assert kept(out) == want, n


def test_min_tokens_ban_beats_positive_bias():
    params = SamplingParams(temperature=0, min_tokens=1, logit_bias={EOS: 100})
    out = process_one(torch.zeros(V), params)
    assert out[EOS] == NEG_INF and int(out.argmax()) != EOS


def test_top_logprobs_rank_and_values():
    lp = torch.log_softmax(torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 1.0, -1.0]]), -1)
    top = TopLogprobs.gather(lp, torch.tensor([2, 3]), 2)
    torch.testing.assert_close(top.chosen, lp[[0, 1], [2, 3]])
    assert top.rank.tolist() == [2, 4]
    assert top.ids[0].tolist() == [1, 2] and top.ids[1, 0] == 2
    torch.testing.assert_close(top.values, lp.topk(2, dim=-1).values)
    first, second = top.entries([(0, 2, 2), (1, 3, 1)])
    v = lp.tolist()
    assert first == {2: (v[0][2], 2), 1: (v[0][1], 1)}  # the chosen token, then the top 2
    assert second == {3: (v[1][3], 4), 2: (v[1][2], 1)}


# ---- the sampled distribution --------------------------------------------------------------
STAT_LOGITS = torch.tensor([1.0, -1.5, 2.0, 0.2, -2.5, 1.3, -0.3, 1.6, -0.8, 0.6])
STAT_PARAMS = dict(temperature=0.7, top_k=6, top_p=0.9)  # top-k then top-p: 4 tokens left
NUM_DRAWS = 100_000


def draw_counts(params: SamplingParams, num_draws: int, seed: int) -> np.ndarray:
    """Counts of num_draws tokens sampled from STAT_LOGITS, all rows in one batch. Calls
    `process_logits` through the module so a test can monkeypatch it."""
    req = make_request(params)
    batch = SamplingBatch.from_requests([req] * num_draws, V)
    processed = sampler_mod.process_logits(STAT_LOGITS.repeat(num_draws, 1), batch)
    tokens = sample(processed, batch, torch.Generator().manual_seed(seed))
    return np.bincount(tokens.numpy(), minlength=V)


def fit_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of counts against probs; 0 when a zero-probability token occurs."""
    support = probs > 0
    if counts[~support].any():
        return 0.0
    return float(chisquare(counts[support], counts.sum() * probs[support]).pvalue)


def expected_stat_probs() -> np.ndarray:
    want = reference_probs(STAT_LOGITS.numpy(), **STAT_PARAMS)
    assert np.count_nonzero(want) == 4  # top-k's renormalisation matters: 5 without it
    assert np.count_nonzero(reference_probs(STAT_LOGITS.numpy(), 0.7, top_p=0.9)) == 5
    return want


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_distribution_chi_square(seed):
    counts = draw_counts(SamplingParams(**STAT_PARAMS), NUM_DRAWS, seed)
    assert fit_pvalue(counts, expected_stat_probs()) > 0.01


def test_seeded_generator_samples_the_same_distribution():
    # One seeded request repeated: every row draws from the request's own generator.
    counts = draw_counts(SamplingParams(**STAT_PARAMS, seed=5), 20_000, seed=0)
    assert fit_pvalue(counts, expected_stat_probs()) > 0.01


def _unprocessed(logits, batch):
    return logits.clone()


def _top_p_on_untruncated(logits, batch):
    """Top-p measured on the full tempered distribution, not the top-k renormalised one."""
    tempered = logits / batch.temperature[:, None]
    probs = tempered.softmax(-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= batch.top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    kth = tempered.topk(int(batch.top_k.max()), dim=-1).values[:, -1:]
    return tempered.masked_fill(drop | (tempered < kth), NEG_INF)


def _untempered_final(logits, batch):
    """The right support, but sampled at temperature 1."""
    return logits.masked_fill(process_logits(logits, batch).isinf(), NEG_INF)


@pytest.mark.parametrize("broken", [_unprocessed, _top_p_on_untruncated, _untempered_final])
def test_chi_square_rejects_broken_sampler(monkeypatch, broken):
    monkeypatch.setattr(sampler_mod, "process_logits", broken)
    counts = draw_counts(SamplingParams(**STAT_PARAMS), NUM_DRAWS, seed=0)
    assert fit_pvalue(counts, expected_stat_probs()) < 1e-6


# ---- seeded reproducibility ----------------------------------------------------------------
def test_seeded_row_independent_of_position_and_neighbours():
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.zeros(8, V)  # uniform: every draw depends on the noise alone

    def draws(position: int, neighbours: list[SamplingParams], steps: int = 20) -> list[int]:
        target = make_request(params)
        reqs = [make_request(p) for p in neighbours]
        reqs.insert(position, target)
        batch = SamplingBatch.from_requests(reqs, V)
        g = torch.Generator().manual_seed(position)
        rows = logits[: len(reqs)]
        return [int(sample(process_logits(rows, batch), batch, g)[position]) for _ in range(steps)]

    alone = draws(0, [])
    mixed = [
        SamplingParams(temperature=1.0, seed=s) if s % 2 else SamplingParams() for s in range(7)
    ]
    assert draws(0, mixed) == alone
    assert draws(7, mixed) == alone
    assert draws(3, [SamplingParams(temperature=0)] * 4) == alone
    assert len(set(alone)) > 3  # the draws are random, not constant


def test_seeded_request_through_engine_any_batch_position(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=128, seed=0)
    target = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    prompt = list(range(60, 80))

    def neighbours(offset: int) -> tuple[list, list]:
        g = torch.Generator().manual_seed(offset)
        prompts = [torch.randint(0, 256, (3 + 4 * i,), generator=g).tolist() for i in range(7)]
        params = [
            SamplingParams(temperature=0.9, seed=offset + i, max_tokens=5 + i, ignore_eos=True)
            if i % 2
            else SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
            for i in range(7)
        ]
        return prompts, params

    def tokens(prompts, params, position):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs[position].outputs[0].token_ids

    alone = tokens([prompt], [target], 0)
    p, s = neighbours(1)
    first = tokens([prompt] + p, [target] + s, 0)
    p, s = neighbours(2)
    last = tokens(p + [prompt], s + [target], 7)
    assert first == alone and last == alone
    other_seed = SamplingParams(temperature=1.0, seed=43, max_tokens=12, ignore_eos=True)
    assert tokens([prompt], [other_seed], 0) != alone  # the seed matters: not vacuous


def test_argmax_suffices_only_for_plain_greedy(tiny_llama):
    from engine.sampler import argmax_suffices

    llm = LLM(str(tiny_llama), num_kv_blocks=16)
    plain = dict(temperature=0, max_tokens=4)
    cases = {
        "plain": (SamplingParams(**plain), True),
        "sampled": (SamplingParams(temperature=0.7, max_tokens=4), False),
        "logprobs": (SamplingParams(**plain, logprobs=0), False),
        "bias": (SamplingParams(**plain, logit_bias={3: 1.0}), False),
        "penalty": (SamplingParams(**plain, repetition_penalty=1.2), False),
        "min_tokens": (SamplingParams(**plain, min_tokens=2), False),
        "regex": (SamplingParams(**plain, structured_outputs={"regex": "[a-c]+"}), False),
    }
    for name, (params, _) in cases.items():
        llm.engine.add_request(name, [5, 6, 7], params)
    requests = {r.request_id: r for r in llm.engine.scheduler.waiting}
    assert {name: argmax_suffices(requests[name]) for name in cases} == {
        name: want for name, (_, want) in cases.items()
    }


def mixed_greedy_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy requests the fast path serves, next to greedy ones the full pipeline must shape
    (bias, penalty, min_tokens, logprobs, a grammar) and sampled ones, with n-gram drafts."""
    base = dict(temperature=0, max_tokens=12, ignore_eos=True)
    params = [
        SamplingParams(**base),
        SamplingParams(**base, logit_bias={17: 8.0, 40: 5.0}),
        SamplingParams(**base, repetition_penalty=1.8),
        SamplingParams(**{**base, "ignore_eos": False}, min_tokens=6),
        SamplingParams(**base, logprobs=3),
        SamplingParams(**base, structured_outputs={"regex": "[a-f]{3,9}"}),
        SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
        SamplingParams(**base, n=2),
    ]
    prompts = [[9 + i, 10, 11, 12] * 4 for i in range(len(params))]  # repeats: n-gram drafts
    return prompts, params


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("broken", [False, True])
def test_device_argmax_path_equals_full_pipeline(tiny_llama, monkeypatch, method, broken):
    """Rows of plain greedy requests are decided by their argmax alone, and a draft model's
    proposals for requests whose pipeline cannot move the argmax too: every request's tokens,
    logprobs and speculation counts equal those of the full host pipeline for every row. A
    predicate that lets every greedy request (every draft) skip the pipeline fails."""
    import engine.model_runner as model_runner
    import spec.draft_model as draft

    prompts, params = mixed_greedy_workload()
    spec_args = (
        dict(speculative_method="ngram", adaptive_speculation=False)
        if method == "ngram"
        else dict(draft_model=str(tiny_llama), adaptive_speculation=False)  # drafts that hit
    )

    def run(is_fast, keeps):
        monkeypatch.setattr(model_runner, "argmax_suffices", is_fast)
        monkeypatch.setattr(draft, "keeps_argmax", keeps)
        llm = LLM(str(tiny_llama), num_kv_blocks=128, **spec_args)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_usable
        spec = [
            (s.num_drafts, s.num_accepted, s.accepted_at) for s in (o.metrics.spec for o in outs)
        ]
        return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs], spec

    from engine.sampler import argmax_suffices, keeps_argmax

    never = lambda request: False  # noqa: E731
    full = run(never, never)
    if not broken:
        assert run(argmax_suffices, keeps_argmax) == full
    elif method == "ngram":
        assert run(lambda request: request.params.is_greedy, never) != full
    else:
        assert run(never, lambda request: True) != full
