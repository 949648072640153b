"""Adaptive speculation: the cost fits, the acceptance estimates, the planner against exhaustive
search, and the engine: lossless, off where drafting cannot pay, on where it does."""

from __future__ import annotations

import itertools
import random

import pytest

from engine import LLM, SamplingParams
from engine.step_budget import LinearCost
from spec.adaptive import Acceptance, AdaptiveSpeculation, Candidate, StepCost

SMOL = "smollm2-135m-instruct"  # the exact weights where tokens are compared


# ---- cost fit -------------------------------------------------------------------------------
def test_linear_cost_recovers_fixed_and_per_row_cost():
    cost = LinearCost()
    rng = random.Random(0)
    for _ in range(200):
        rows = rng.randint(1, 64)
        cost.observe(rows, 0.05 + 0.002 * rows)
    assert cost.fixed == pytest.approx(0.05, rel=1e-6)
    assert cost.per_row == pytest.approx(0.002, rel=1e-6)


def test_linear_cost_needs_two_row_counts_and_keeps_its_last_fit():
    cost = LinearCost()
    for _ in range(50):
        cost.observe(8, 0.1)
    assert not cost.fitted  # one row count says nothing about the per-row cost
    cost.observe(16, 0.14)
    cost.observe(4, 0.08)
    assert cost.fitted
    assert (cost.fixed, cost.per_row) == pytest.approx((0.06, 0.005))
    rng = random.Random(0)
    for _ in range(500):  # the spread decays away: the fit stays, it is not refitted on noise
        cost.observe(8, 0.1 + 1e-4 * rng.random())
    assert (cost.fixed, cost.per_row) == pytest.approx((0.06, 0.005), rel=0.01)


def test_step_cost_separates_rows_from_the_context_they_attend():
    """A verified row reads its whole context (one CPU thread: ~7 ms a row at 0.8k tokens, ~20
    ms at 3.6k). Steps at batch 1 of 1-16 rows at contexts 800-3600, timed 20 ms + 1 ms a row
    + 5 us per attended key: the fit recovers all three; keys that never vary apart from rows
    (one context) leave the rows-only line (per_key 0)."""
    cost = StepCost()
    for i in range(60):
        context, rows = 800 + 47 * i, 1 + (7 * i) % 16
        cost.observe(rows, 0.02 + 0.001 * rows + 5e-6 * rows * context, rows * context)
    assert (cost.fixed, cost.per_row, cost.per_key) == pytest.approx((0.02, 0.001, 5e-6))
    assert cost.row(3600) == pytest.approx(0.019)
    # Deep in, rows cost attention only (20 ms + 5 us per key): a slope over rows fitted below
    # zero by noise keeps the keys' term (a rows-only line would price a row at 3.6k tokens
    # everywhere, and stay so while steps keep one row).
    deep = StepCost()
    for i in range(60):
        context, rows = 3600 + 3 * i, 1 + (5 * i) % 8
        noise = 0.0005 * (-1) ** i * (rows > 4)  # slower short steps, faster long ones
        deep.observe(rows, 0.02 + 5e-6 * rows * context - noise, rows * context)
    assert deep.per_row == 0.0 and deep.per_key == pytest.approx(5e-6, rel=0.05)
    flat = StepCost()
    for rows in (1, 9, 3, 27):
        flat.observe(rows, 0.02 + 0.004 * rows, rows * 1000)
    assert (flat.fixed, flat.per_row, flat.per_key) == pytest.approx((0.02, 0.004, 0.0))


def test_a_row_is_priced_at_its_own_context():
    """The agent loop's collapse (bench.agent_suffix, 2026-11-27): after deep-context steps where
    a verified row cost ~30 ms, a rows-only line priced every row so at the next conversation's
    start too (0.8k tokens, ~7 ms a row), drafted nothing, and with one-row steps only never
    refitted. Priced per attended key, the same history drafts at 800 tokens and not at 3600:
    a draft landing 40% of the time adds 0.4 token for 5 ms to a plain step's 1 for 25 ms at
    800, for 19 ms to 1 for 39 ms at 3600 (a rows-only line: 17.5 ms at both, no drafts)."""
    spec = AdaptiveSpeculation(uses_draft_model=False)
    for i in range(60):
        context, rows = 3000 + 10 * i, 1 + (7 * i) % 16
        spec.observe_target(
            rows, False, 0.02 + 0.001 * rows + 5e-6 * rows * context, rows * context
        )
    for _ in range(40):  # one-row steps deep in: nothing to refit from, the fit is kept
        spec.observe_target(1, False, 0.02 + 0.001 + 5e-6 * 3600, 3600)
    c = Candidate(0.4, 8)
    shallow, deep = (
        Candidate(**{**vars_of(c), "context": 800}),
        Candidate(**{**vars_of(c), "context": 3600}),
    )
    assert spec.plan([shallow]) == [1]
    assert spec.plan([deep]) == [0]


def vars_of(c: Candidate) -> dict:
    return {f: getattr(c, f) for f in c.__dataclass_fields__}


def test_acceptance_estimate_tracks_a_geometric_process():
    rng = random.Random(1)
    for true_rate in (0.2, 0.6, 0.9):
        own = Acceptance()
        estimates = []
        for step in range(4000):
            k = 4
            accepted = 0
            while accepted < k and rng.random() < true_rate:
                accepted += 1
            own.observe(k, accepted, decay=0.99)
            if step > 1000:
                estimates.append(own.rate(0.5, 2.0))
        assert sum(estimates) / len(estimates) == pytest.approx(true_rate, abs=0.03)


def test_reach_follows_the_acceptance_profile_by_depth():
    """First drafts land 60% of the time, later ones 95%: the planner's P(reach j) follows that
    profile, where one pooled rate a (about 0.88 here) would say a^j: too high at the first
    position, too low at the later ones."""
    spec = planner(fixed=0.5, per_row=0.01)
    rng = random.Random(2)
    own = Acceptance()
    for _ in range(3000):
        accepted = 0
        while accepted < 6 and rng.random() < (0.6 if accepted == 0 else 0.95):
            accepted += 1
        spec.observe_verification(own, 6, accepted)
    reach = spec.candidate(own, 6, 1, 100).reach
    # Decayed counts are a window of ~50 verifications: estimates move by ~0.07 around the truth.
    for j, p in enumerate(reach, start=1):
        assert p == pytest.approx(0.6 * 0.95 ** (j - 1), abs=0.12)
    assert all(later / earlier > 0.85 for earlier, later in zip(reach[:-1], reach[1:], strict=True))
    flat = spec.acceptance(own)
    assert reach[0] < flat - 0.15 and reach[5] / reach[4] > flat
    # A request doing worse than the engine is shifted down at every depth, not flattened.
    poor = Acceptance()
    for _ in range(50):
        spec.observe_verification(poor, 6, 0)
    reach = spec.candidate(poor, 3, 1, 100).reach
    assert reach[0] < 0.2 and reach[2] < reach[0]


# ---- the planner ------------------------------------------------------------------------------
def planner(fixed, per_row, draft=None) -> AdaptiveSpeculation:
    """A planner whose cost fits hold exactly the given lines."""
    spec = AdaptiveSpeculation(uses_draft_model=draft is not None)
    fits = [(spec.target, fixed, per_row)]
    if draft is not None:
        fits.append((spec.draft, *draft))
    for fit, a, b in fits:
        for rows in (1, 9, 3, 27):
            fit.observe(rows, a + b * rows)
    return spec


def goodput(spec: AdaptiveSpeculation, cands: list[Candidate], ks: list[int]) -> float:
    tokens = sum(sum(c.acceptance**j for j in range(k + 1)) for c, k in zip(cands, ks, strict=True))
    seconds = spec.target(len(cands) + sum(ks))
    if spec.draft is not None:
        for level in range(1, max(ks, default=0) + 1):
            rows = [
                c.catch_up_rows if level == 1 else 1
                for c, k in zip(cands, ks, strict=True)
                if k >= level
            ]
            if rows:
                seconds += spec.draft(sum(rows))
    return tokens / seconds


def test_early_rejections_do_not_switch_speculation_off_for_good():
    """One bad first verification sets every estimate low and the plan to k = 0; steps without
    drafts fade the estimates back towards the prior until drafting is tried again."""
    spec = planner(fixed=0.6, per_row=0.02, draft=(0.1, 0.004))
    own = Acceptance()
    spec.observe_verification(own, 6, 0)
    assert spec.plan([spec.candidate(own, 6, 1, 100)]) == [0]
    idle_steps = 0
    while not spec.plan([spec.candidate(own, 6, 1, 100)])[0]:
        spec.idle(own)
        idle_steps += 1
        assert idle_steps < 60, "speculation never resumed"


def test_a_fit_that_prices_rows_dear_still_tries_a_draft_and_resumes_when_drafts_land():
    """The fit measured on the agent benchmark at ~2,500 tokens of context, 1 thread (6.5 ms +
    10.8 ms a verified row): at the prior rate (0.5) no draft pays, and an idle planner's fit
    never changes, so n-gram stayed off for whole conversations whose drafts land 90% of the
    time. After EXPLORE_AFTER idle plans one draft is tried; drafts that land bring the full
    plan back; rejected tries wait twice as long each time, up to EXPLORE_AFTER_MAX."""
    spec = planner(fixed=0.0065, per_row=0.0108)
    own = Acceptance()

    def plans_until_a_draft(limit: int = 1000) -> int:
        for n in range(1, limit + 1):
            if spec.plan([spec.candidate(own, 4, 1, 100)])[0]:
                return n
            spec.idle(own)
        return limit + 1

    assert plans_until_a_draft() == AdaptiveSpeculation.EXPLORE_AFTER
    for _ in range(6):  # the tries land: each verification raises the estimate
        spec.observe_verification(own, 1, 1)
        if spec.plan([spec.candidate(own, 4, 1, 100)])[0] == 4:
            break
    assert spec.plan([spec.candidate(own, 4, 1, 100)]) == [4]

    bad = planner(fixed=0.0065, per_row=0.0108)
    spec, own = bad, Acceptance()
    waits = []
    for _ in range(6):  # tries rejected: 16, 32, 64, 128, 256, 256 plans apart
        waits.append(plans_until_a_draft())
        spec.observe_verification(own, 1, 0)
    assert waits == [16, 32, 64, 128, 256, 256]

    # A draft model's first draft after idle steps computes all it sat out: no tries there.
    spec, own = planner(fixed=0.0065, per_row=0.0108, draft=(0.004, 0.002)), Acceptance()
    assert plans_until_a_draft() > 1000


def test_not_ready_planner_alternates_caps_and_no_drafts():
    """Until the fits are ready, steps alternate between every cap and no drafts, so decode
    steps come in two row counts even where every request always drafts its cap (a self-draft
    at batch 1) and the target's line, fitted on decode steps only, becomes ready."""
    spec = AdaptiveSpeculation(uses_draft_model=False)
    cands = [Candidate(0.9, 4), Candidate(0.1, 2)]
    assert [spec.plan(cands) for _ in range(3)] == [[4, 2], [0, 0], [4, 2]]
    spec.observe_target(7, False, 0.05 + 0.002 * 7)
    spec.observe_target(2, False, 0.05 + 0.002 * 2)
    assert spec.ready


def test_free_drafts_at_batch_one_take_the_cap_and_large_batches_switch_off():
    spec = planner(fixed=0.05, per_row=0.0005)  # memory-bound: a row is 1% of a step
    assert spec.plan([Candidate(0.8, 5)]) == [5]
    spec = planner(fixed=0.1, per_row=0.01)  # 64 rows: compute-bound, every row costs
    assert spec.plan([Candidate(0.6, 5)] * 64) == [0] * 64
    # ... unless acceptance is near certain: a draft then costs a row and returns ~a row,
    # more than the 0.86 rows per row-time of a plain step (64 / (0.1 + 0.64 s)).
    assert min(spec.plan([Candidate(0.98, 5)] * 64)) >= 1


def test_free_drafts_are_priced_as_part_of_the_step():
    """A prediction's 31 drafts ride ahead of the proposer's: the step already yields ~32 tokens
    for 32 rows, so a draft accepted half the time, which pays beside a lone decode row (1.5
    tokens in 0.12 s against 1 in 0.11 s), no longer does (32.5 in 0.43 s against 32 in 0.42 s);
    a near-certain one still does."""
    spec = planner(fixed=0.1, per_row=0.01)
    assert spec.plan([Candidate(0.5, 4)]) == [2]
    assert spec.plan([Candidate(0.5, 4, num_free=31)]) == [0]
    assert spec.plan([Candidate(0.98, 4, num_free=31)]) == [4]


def test_low_acceptance_requests_drop_out_first():
    spec = planner(fixed=0.2, per_row=0.01)
    ks = spec.plan([Candidate(0.9, 4), Candidate(0.05, 4), Candidate(0.7, 4)] + [Candidate(0.4, 4)])
    assert ks[1] == 0 and ks[0] >= ks[2] >= ks[3] and ks[0] > 0


def test_expensive_draft_passes_shorten_k():
    cheap = planner(fixed=0.5, per_row=0.002, draft=(0.02, 0.001))
    dear = planner(fixed=0.5, per_row=0.002, draft=(0.3, 0.001))
    same = planner(fixed=0.5, per_row=0.002, draft=(0.5, 0.002))  # drafting with the target
    c = [Candidate(0.85, 8)]
    assert cheap.plan(c)[0] > dear.plan(c)[0] > 0
    assert same.plan(c) == [0]


def test_batch_16_drafts_nothing_where_a_verified_row_costs_a_decode_rows_price():
    """Issue 40 point 4. A CPU-like target: a decode step costs 40 ms + 3 ms a row, and a step
    that also carries a prompt chunk adds 0.5 ms per prompt row (one GEMM over its 400 rows).
    At batch 16 a draft landing half the time returns 0.5 token for 3 ms, less than a plain
    step's 16 tokens / 88 ms: no drafts. At batch 1 (1 token / 43 ms) the same drafts pay, up
    to k = 3. Fitted on the chunked steps too, the line's slope falls towards 0.5 ms a row and
    the planner drafts at batch 16 (serving at c16 lost 14% so; a GPU at batch 32 half)."""
    spec = AdaptiveSpeculation(uses_draft_model=False)
    for batch in (16, 12, 16, 14, 16, 15) * 4:
        for rows in (batch, 2 * batch):  # plain decode steps, and steps verifying 1 draft each
            spec.observe_target(rows, False, 0.04 + 0.003 * rows)
        spec.observe_target(batch + 400, True, 0.04 + 0.003 * batch + 0.0005 * 400)
    assert spec.plan([Candidate(0.5, 4)] * 16) == [0] * 16
    assert spec.plan([Candidate(0.5, 4)]) == [3]
    assert (spec.target.fixed, spec.target.per_row) == pytest.approx((0.04, 0.003))


def test_a_far_behind_draft_catches_up_only_where_the_steps_left_repay_it():
    """Issue 42 point 5. An fp32 target (70 ms + 2 ms a row) drafted for by its GGUF self
    (20 ms + 2.8 ms a row: 5.8 s to catch up on a 2048-token prompt it never saw); drafts land
    ~88% of the time. With 63 tokens left the catch-up cannot be repaid (plain decoding takes
    4.5 s in all): no drafts. With 2000 left, or a draft already caught up, it drafts. Priced
    at cap + 1 rows whatever the lag, the first case drafts (the suite's 0.52x at 2048). A
    512-token gap with 63 left is repaid at k = 4 though not at k = 1 (the catch-up is paid
    with the first draft): the plan looks past a first level that loses."""
    spec = planner(fixed=0.07, per_row=0.002, draft=(0.02, 0.0028))
    own = Acceptance(accepted=90.0, trials=100.0)

    def ks(lag: int, remaining: int) -> list[int]:
        return spec.plan([spec.candidate(own, 4, lag, remaining)])

    assert ks(2049, 63) == [0]
    assert ks(2049, 2000) == [4]
    assert ks(4, 63) == [4]
    assert ks(513, 63) == [4]


def test_a_closed_batch_drops_drafts_its_slowest_request_outlasts():
    """Issue 42 point 5, the suite's mixed batch 4: two requests copying their prompt (drafts
    land 90%) and two open-ended ones (prompt lookup has drafts on 5% of their steps), EOS
    ignored. Served, every request's own finish counts and the grounded ones draft. In a
    closed batch (an offline generate) the open-ended ones set the steps left (48 tokens at
    ~1.02 a step) and the grounded ones finish within them even undrafted (40 left): their
    drafts would only add rows, so they are dropped. Grounded requests alone keep drafting, and
    a request outside the plan that surely runs longer (closed_steps) stops a lone one."""
    spec = planner(fixed=0.05, per_row=0.002)
    grounded = Candidate(0.9, 4, remaining=40, must_run=40)
    open_ended = Candidate(0.3, 4, remaining=48, must_run=48, offered=0.05)
    batch = [grounded, open_ended, grounded, open_ended]
    served = spec.plan(batch)
    assert served[0] == served[2] == 4 and served[1] > 0
    closed = spec.plan(batch, closed_steps=0)
    assert closed[0] == closed[2] == 0 and closed[1::2] == served[1::2]
    assert spec.plan([grounded] * 4, closed_steps=0) == [4] * 4
    assert spec.plan([grounded], closed_steps=40) == [0]
    assert spec.plan([grounded], closed_steps=39) == [4]


def test_a_batch_is_closed_until_a_request_joins_it():
    """Offline generate() adds every request before the first step: closed until the engine
    starts afresh. A request joining while others run (a server's stream), or any request
    waiting for a slot, opens it; must_run counts only requests nothing but length can end."""
    from engine.request import Request
    from spec.proposer import NgramProposer
    from spec.speculation import Speculation, must_run

    def request(name: str, **params) -> Request:
        params = SamplingParams(max_tokens=8, **params)
        return Request(name, [1, 2, 3], params, eos_token_ids={0}, max_model_len=64)

    spec = Speculation(NgramProposer(), 4, AdaptiveSpeculation(uses_draft_model=False))
    a, b, c, d, e = (request(n, ignore_eos=True) for n in "abcde")
    closed = [
        spec._batch_closed([a, b], []),
        spec._batch_closed([a], []),  # b finished
        spec._batch_closed([a, c], []),  # c joined
        spec._batch_closed([a], []),
        spec._batch_closed([d], []),  # afresh
        spec._batch_closed([d], [e]),  # e waits (and joined)
        spec._batch_closed([], []),
        spec._batch_closed([b], [c]),  # afresh, but c waits for a slot
    ]
    assert closed == [True, True, False, False, True, False, True, False]
    assert must_run(a) == 8 and must_run(request("f")) == 0
    assert must_run(request("g", min_tokens=3)) == 3
    assert must_run(request("h", ignore_eos=True, stop=["."])) == 0


@pytest.mark.parametrize("seed", range(40))
def test_plan_is_near_the_exhaustive_optimum(seed):
    rng = random.Random(seed)
    draft = None if seed % 2 else (rng.uniform(0.0, 0.3), rng.uniform(0.0, 0.01))
    spec = planner(rng.uniform(0.01, 0.5), rng.uniform(0.0005, 0.05), draft)
    cands = [
        Candidate(rng.uniform(0.0, 0.98), rng.randint(0, 3), rng.randint(1, 4))
        for _ in range(rng.randint(1, 4))
    ]
    best = max(
        goodput(spec, cands, list(ks))
        for ks in itertools.product(*(range(c.cap + 1) for c in cands))
    )
    ks = spec.plan(cands)
    assert all(0 <= k <= c.cap for k, c in zip(ks, cands, strict=True))
    assert goodput(spec, cands, ks) >= 0.98 * best


# ---- through the engine -----------------------------------------------------------------------
def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(256) for _ in range(rng.randint(3, 8))]
        out.append((phrase * 10)[: rng.randint(20, 60)])
    return out


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"], "blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", ["ngram", "draft", "suffix", "suffix+draft"])
def test_adaptive_is_lossless(tiny_llama, draft_model, method):
    prompts = repetitive_prompts(24) + [[i % 250 + 1 for i in range(j, j + 30)] for j in range(8)]
    want = generate(LLM(str(tiny_llama), num_kv_blocks=256), prompts)
    args = {
        "ngram": {"speculative_method": "ngram"},
        "draft": {"draft_model": str(draft_model)},
        "suffix": {"speculative_method": "suffix"},
        "suffix+draft": {"speculative_method": "suffix", "draft_model": str(draft_model)},
    }
    for max_num_seqs in (1, 32):
        llm = LLM(str(tiny_llama), num_kv_blocks=256, max_num_seqs=max_num_seqs, **args[method])
        assert generate(llm, prompts) == want


def test_adaptive_switches_a_useless_draft_off(tiny_llama, draft_model):
    """A random draft model is almost never right: after a few steps nobody drafts any more,
    where a fixed k keeps paying for drafts on every step."""
    prompts = repetitive_prompts(8)
    fixed = LLM(str(tiny_llama), draft_model=str(draft_model), adaptive_speculation=False)
    adaptive = LLM(str(tiny_llama), draft_model=str(draft_model))
    assert generate(fixed, prompts) == generate(adaptive, prompts)
    fixed_stats, adaptive_stats = fixed.engine.speculation.stats, adaptive.engine.speculation.stats
    assert fixed_stats.acceptance_rate < 0.2
    assert adaptive_stats.num_drafts < 0.2 * fixed_stats.num_drafts
    view = adaptive.engine.snapshot()["speculation"]["adaptive"]
    assert view["ready"] and view["target_cost"]["seconds_per_row"] >= 0.0
    assert view["draft_cost"]["fixed_seconds"] > 0.0 and view["engine_acceptance"] < 0.5
    assert fixed.engine.snapshot()["speculation"]["adaptive"] is None


def test_adaptive_keeps_free_drafts_that_land():
    """n-gram drafts cost no draft pass and land when the answer copies the prompt (SmolLM2,
    real weights): speculation stays on, and the output is plain greedy's."""
    passage = (
        "Blocks are allocated from a free pool on demand, and full blocks are hashed so that "
        "requests with a common prefix share them."
    )
    llm = LLM(SMOL, quantization=None, speculative_method="ngram", num_kv_blocks=64)
    chat = [{"role": "user", "content": f"Repeat this sentence exactly:\n\n{passage}"}]
    prompt = llm.apply_chat_template(chat)
    params = SamplingParams(temperature=0, max_tokens=32)
    out = generate(llm, [prompt], params)
    plain = LLM(SMOL, quantization=None, num_kv_blocks=64)
    assert out == generate(plain, [prompt], params)
    stats = llm.engine.speculation.stats
    assert stats.acceptance_rate > 0.5 and stats.mean_accepted_length > 2.5
    assert stats.num_steps >= 0.8 * (llm.engine.num_steps - 1)  # the prefill step drafts nothing


def test_draft_lags_while_off_and_prefix_hits_know_its_kv(tiny_llama):
    """A request that does not speculate never runs the draft model, yet its blocks are prefix
    cached; a later request inherits the draft's KV only for blocks the draft computed."""
    llm = LLM(str(tiny_llama), num_kv_blocks=64, block_size=4, draft_model=str(tiny_llama))
    engine = llm.engine
    prompt = list(range(1, 30))
    off = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, num_speculative_tokens=0)
    on = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, num_speculative_tokens=2)
    first = generate(llm, [prompt], off)
    assert engine.speculation.stats.num_drafts == 0
    assert sum(engine.kv.pool.draft_ready) == 0  # the draft never ran
    assert generate(llm, [prompt], on) == first  # hits the cache, catches the draft up
    assert engine.kv.num_hit_tokens >= 28 and engine.speculation.stats.num_accepted > 0
    assert sum(engine.kv.pool.draft_ready) >= 7
    engine.add_request("third", prompt, on)
    engine.step()
    third = next(r for r in engine.kv.block_tables if r.request_id == "third")
    assert third.num_draft_computed >= 28  # its prefix hit carried the draft's KV along
    while engine.has_unfinished_requests():
        engine.step()


def test_seeded_sampling_unchanged_by_adaptive_speculation():
    """k now depends on timing and load, and still a seeded request's tokens do not: they are
    the tokens plain sampling gives (SmolLM2 copying its prompt, so drafts land)."""
    llm = LLM(SMOL, quantization=None, speculative_method="ngram", num_kv_blocks=128)
    texts = [
        "Repeat exactly: the quick brown fox jumps over the lazy dog, twice over.",
        "Copy this list: apples, pears, plums, cherries, grapes, figs, dates.",
        "Say back to me: paged attention keeps the KV cache in fixed-size blocks.",
    ]
    prompts = [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    ps = [SamplingParams(temperature=0.8, top_p=0.95, seed=7 + i, max_tokens=24) for i in range(3)]
    want = generate(LLM(SMOL, quantization=None, num_kv_blocks=128), prompts, ps)
    assert generate(llm, prompts, ps) == want
    assert llm.engine.speculation.stats.num_accepted > 0


# ---- int8 draft models --------------------------------------------------------------------------
def test_int8_linear_is_close_to_fp32():
    import torch

    from engine.models.quant import int8_linear_available, linear_int8, pack_int8

    if not int8_linear_available():
        pytest.skip("no x86/fbgemm quantized backend")
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    for rows in (1, 5, 33):
        x = torch.randn(rows, 64, generator=gen)
        want = torch.nn.functional.linear(x, weight, bias)
        got = linear_int8(x, pack_int8(weight, bias))
        assert float((got - want).norm() / want.norm()) < 0.03


def test_int8_self_draft_on_real_weights_is_lossless_and_mostly_accepted():
    """SmolLM2 drafting for itself with int8 weights: the output is fp32 greedy's, token for
    token, and the quantized copy still agrees with the fp32 model on most drafts."""
    llm = LLM(
        "smollm2-135m-instruct",
        quantization=None,
        draft_model="smollm2-135m-instruct",
        draft_quantization="dynamic-int8",
        num_kv_blocks=64,
        adaptive_speculation=False,
    )
    from engine.models.layers import DynamicInt8

    assert isinstance(llm.engine.draft_runner.model.lm_head.format, DynamicInt8)
    chat = [{"role": "user", "content": "Explain what a hash table is in two sentences."}]
    prompt = llm.apply_chat_template(chat)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM("smollm2-135m-instruct", quantization=None, num_kv_blocks=64)
    assert generate(llm, [prompt], params) == generate(plain, [prompt], params)
    assert 0.5 < llm.engine.speculation.stats.acceptance_rate < 1.0  # 0.71-0.75 here (AVX-512 VNNI)
