"""Speculative decoding through the engine: lossless greedy output, accounting, no leaked block.

The reference is the same engine without speculation (itself held to HF transformers by
test_parity and to batch/chunk/cache/preemption invariance by test_invariance). Proposers: n-gram
prompt lookup; a different random draft model (acceptance near 0: nearly every draft rejected, so
rollback runs on almost every step); and the target as its own draft (acceptance exactly 1.0:
k + 1 tokens per step).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from engine import LLM, SamplingParams
from models import make_tiny_model

NUM_PROMPTS = 100


def prompts() -> list[list[int]]:
    """Half repetitive (a random phrase repeated: n-gram lookup finds it), half random."""
    rng = random.Random(0)
    out = []
    for i in range(NUM_PROMPTS):
        if i % 2:
            phrase = [rng.randrange(256) for _ in range(rng.randint(2, 9))]
            out.append((phrase * 8)[: rng.randint(12, 60)])
        else:
            out.append([rng.randrange(256) for _ in range(rng.randint(1, 60))])
    return out


def params() -> list[SamplingParams]:
    # Varied lengths; a third may stop at EOS, so a stop can land inside a multi-token step.
    return [
        SamplingParams(temperature=0, max_tokens=8 + i % 17, ignore_eos=i % 3 != 0)
        for i in range(NUM_PROMPTS)
    ]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=512)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params(), use_tqdm=False)]


def spec_args(method: str, tiny_llama, draft_model) -> dict:
    """A fixed k per step and an fp32 draft, so a self-draft accepts everything (adaptive
    speculation and int8 drafts have their own tests in test_adaptive.py)."""
    return {
        "ngram": {"speculative_method": "ngram"},
        "draft": {"draft_model": str(draft_model), "draft_quantization": None},
        "self": {"draft_model": str(tiny_llama), "draft_quantization": None},
        "quantized-self": {"draft_model": "self", "draft_quantization": "int8"},
    }[method] | {"adaptive_speculation": False}


def run(tiny_llama, draft_model, method, **engine_args):
    llm = LLM(str(tiny_llama), **spec_args(method, tiny_llama, draft_model), **engine_args)
    outs = llm.generate(prompts(), params(), use_tqdm=False)
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"], "blocks leaked"
    return [o.outputs[0].token_ids for o in outs], llm.engine, outs


def check_accounting(engine, outs, method):
    stats = engine.speculation.stats
    assert 0 <= stats.num_accepted <= stats.num_drafts
    assert sum(o.metrics.spec.num_drafts for o in outs) == stats.num_drafts
    assert sum(o.metrics.spec.num_accepted for o in outs) == stats.num_accepted
    if method == "self":
        assert stats.num_drafts > 0 and stats.acceptance_rate == 1.0
    if method == "draft":
        assert stats.num_drafts > 0 and stats.acceptance_rate < 0.2
    if method == "ngram":
        assert stats.num_accepted > 0
    if method == "quantized-self":  # int8 of the same weights: most drafts hold
        assert stats.num_accepted > 0.5 * stats.num_drafts > 0, stats.as_dict()


@pytest.mark.parametrize("method", ["ngram", "draft", "self", "quantized-self"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_lossless_batch_32(tiny_llama, draft_model, reference, method, k):
    tokens, engine, outs = run(
        tiny_llama, draft_model, method, num_kv_blocks=512, num_speculative_tokens=k
    )
    assert tokens == reference
    check_accounting(engine, outs, method)


@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_greedy_lossless_small_batches(tiny_llama, draft_model, reference, method, max_num_seqs):
    tokens, _, _ = run(
        tiny_llama,
        draft_model,
        method,
        num_kv_blocks=512,
        num_speculative_tokens=3,
        max_num_seqs=max_num_seqs,
    )
    assert tokens == reference


@pytest.mark.parametrize("method", ["ngram", "draft", "self", "quantized-self"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_lossless_under_preemption(
    tiny_llama, draft_model, reference, method, prefix_caching
):
    # 12 blocks of 16 tokens for up to 32 running requests: preemptions on most steps.
    tokens, engine, outs = run(
        tiny_llama,
        draft_model,
        method,
        num_kv_blocks=12,
        num_speculative_tokens=5,
        max_num_batched_tokens=64,
        enable_prefix_caching=prefix_caching,
    )
    assert tokens == reference
    assert engine.scheduler.num_preemptions > 0
    check_accounting(engine, outs, method)


def test_self_draft_emits_k_plus_one_tokens_per_step(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, **spec_args("self", tiny_llama, None))
    p = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, num_speculative_tokens=4)
    out = llm.generate([[1, 2, 3]], p, use_tqdm=False)[0]
    # 1 token from the prefill step, then 4 steps x (4 drafts + 1), then the last 4 tokens
    # from 3 drafts + 1: k is capped so that nothing is drafted past max_tokens.
    spec = out.metrics.spec
    assert len(out.outputs[0].token_ids) == 25
    assert spec.num_steps == 5 and spec.num_accepted == spec.num_drafts == 19
    assert spec.drafted_at == [5, 5, 5, 4] and spec.acceptance_by_position == [1.0] * 4
    assert llm.engine.num_steps == 6


def test_self_draft_token_kinds(tiny_llama):
    """The self-draft of the test above: 1 plain token, then 4 x (4 accepted + bonus), then
    3 accepted + bonus; nothing rejected."""
    llm = LLM(str(tiny_llama), num_kv_blocks=64, **spec_args("self", tiny_llama, None))
    p = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, num_speculative_tokens=4)
    c = llm.generate([[1, 2, 3]], p, use_tqdm=False)[0].outputs[0]
    assert c.token_kinds == "p" + "aaaab" * 4 + "aaab"
    assert c.rejected_drafts == []


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_token_kinds_match_the_counters(tiny_llama, draft_model, method):
    """One kind per token; accepted drafts as counted; every rejection is followed by the
    resampled token that replaced it, and the rejected ids are not what was emitted there."""
    _, engine, outs = run(tiny_llama, draft_model, method, num_kv_blocks=512)
    rejections = 0
    for out in outs:
        c = out.outputs[0]
        assert len(c.token_kinds) == len(c.token_ids) and set(c.token_kinds) <= set("pabr")
        assert c.token_kinds.count("a") <= out.metrics.spec.num_accepted
        positions = [i for i, kind in enumerate(c.token_kinds) if kind == "r"]
        assert [pos for pos, _ in c.rejected_drafts] == positions
        for pos, ids in c.rejected_drafts:
            assert ids and ids[0] != c.token_ids[pos]
        rejections += len(positions)
    assert rejections > 0 and any("a" in o.outputs[0].token_kinds for o in outs)


def test_per_request_k_and_off_switch(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, **spec_args("self", tiny_llama, None))
    off = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, num_speculative_tokens=0)
    two = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, num_speculative_tokens=2)
    a, b = llm.generate([[5, 6, 7], [5, 6, 7]], [off, two], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.metrics.spec.num_drafts == 0
    assert b.metrics.spec.num_drafts > 0 and len(b.metrics.spec.drafted_at) == 2


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_stop_conditions_exact_inside_multi_token_steps(tiny_llama, draft_model, method):
    """max_tokens, stop_token_ids and stop strings end the output exactly where plain decoding
    does, even when the stopping token arrives in the middle of an accepted run."""
    base = LLM(str(tiny_llama), num_kv_blocks=128)
    spec = LLM(
        str(tiny_llama),
        num_kv_blocks=128,
        num_speculative_tokens=5,
        **spec_args(method, tiny_llama, draft_model),
    )
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    free_run = base.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    stop_token = free_run.token_ids[9]
    stop_text = free_run.text[5:8] if len(free_run.text) > 8 else None
    cases = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token]),
    ]
    if stop_text:
        cases.append(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop_text))
    for p in cases:
        want = base.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        got = spec.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
        )
    snap = spec.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]


@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_seeded_sampling_same_batched_as_alone(tiny_llama, draft_model, method):
    args = spec_args(method, tiny_llama, draft_model)
    ps = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=10 + i, max_tokens=16, ignore_eos=True)
        for i in range(8)
    ]
    batch_prompts = prompts()[:8]
    llm = LLM(str(tiny_llama), num_kv_blocks=256, num_speculative_tokens=3, **args)
    batched = [o.outputs[0].token_ids for o in llm.generate(batch_prompts, ps, use_tqdm=False)]
    for prompt, p, want in zip(batch_prompts, ps, batched, strict=True):
        alone = LLM(str(tiny_llama), num_kv_blocks=256, num_speculative_tokens=3, **args)
        assert alone.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids == want


@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_seeded_sampling_same_with_and_without_speculation(tiny_llama, draft_model, method):
    """Deterministic drafts are verified by drawing what plain sampling would draw at each
    position, so a seeded request emits the same tokens with speculation as without, at any k."""
    ps = [
        SamplingParams(
            temperature=1.0,
            top_k=[0, 20][i % 2],
            min_p=0.02,
            repetition_penalty=1.1,
            seed=40 + i,
            max_tokens=20,
            ignore_eos=True,
        )
        for i in range(12)
    ]
    batch_prompts = prompts()[:12]
    plain = LLM(str(tiny_llama), num_kv_blocks=256)
    want = [o.outputs[0].token_ids for o in plain.generate(batch_prompts, ps, use_tqdm=False)]
    for k in (1, 4):
        llm = LLM(
            str(tiny_llama),
            num_kv_blocks=256,
            num_speculative_tokens=k,
            **spec_args(method, tiny_llama, draft_model),
        )
        outs = llm.generate(batch_prompts, ps, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, k
        stats = llm.engine.speculation.stats
        # Drafts were verified; the self-draft's are mostly accepted, the random draft's
        # mostly rejected (n-gram lookups are rare on sampled random-model text).
        assert stats.num_drafts > 0
        if method == "self":
            assert stats.num_accepted > 0
        elif method == "draft":
            assert stats.num_accepted < stats.num_drafts
    reseeded = [dataclasses.replace(p, seed=p.seed + 1) for p in ps]
    again = plain.generate(batch_prompts, reseeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] != want  # the seeds matter


def test_random_aborts_mid_speculation_return_every_block(tiny_llama, draft_model):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, **spec_args("draft", tiny_llama, draft_model))
    engine = llm.engine
    rng = random.Random(3)
    ps = params()
    for i, prompt in enumerate(prompts()[:40]):
        engine.add_request(str(i), prompt, ps[i])
    live = {str(i) for i in range(40)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
        snap = engine.snapshot()
        used = {b for r in snap["requests"] for b in r["block_table"]}
        assert snap["num_used_blocks"] == len(used)
    snap = engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"] and not snap["requests"]


def test_rejected_drafts_free_their_blocks(tiny_llama, draft_model):
    """With a draft that is almost always wrong, each step allocates room for k drafts and
    gives back the blocks past the accepted length: a running request never holds more blocks
    than its computed tokens need."""
    llm = LLM(
        str(tiny_llama),
        num_kv_blocks=64,
        block_size=4,
        **spec_args("draft", tiny_llama, draft_model),
    )
    engine = llm.engine
    engine.add_request(
        "a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    while engine.has_unfinished_requests():
        engine.step()
        for r in engine.scheduler.running:
            assert len(engine.kv.block_tables.get(r, [])) == -(-r.num_computed_tokens // 4)
    assert engine.speculation.stats.num_drafts > engine.speculation.stats.num_accepted


def test_bad_speculation_config_is_rejected(tiny_llama):
    with pytest.raises(ValueError, match="speculative_method"):
        LLM(str(tiny_llama), speculative_method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(tiny_llama), speculative_method="ngram", num_speculative_tokens=99)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="draft_model"):
        LLM(str(tiny_llama), speculative_method="draft")


def test_draft_with_other_vocabulary_is_rejected(tiny_llama, tmp_path):
    other = make_tiny_model(tmp_path / "big-vocab", "llama", seed=2, vocab_size=384)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(tiny_llama), draft_model=str(other))


def test_snapshot_reports_speculation(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, **spec_args("self", tiny_llama, None))
    params = SamplingParams(temperature=0, max_tokens=10)
    outs = llm.generate([[1, 2, 3], [4, 5, 6, 7]], params, use_tqdm=False)
    engine = llm.engine
    spec = engine.snapshot()["speculation"]
    assert spec["method"] == "draft" and spec["num_drafts"] > 0
    assert spec["acceptance_rate"] == 1.0 and spec["mean_accepted_length"] > 1.0
    assert spec["draft_seconds"] > 0 and spec["verify_seconds"] > 0
    # Per request: its share of each step; the shares add up to the engine's totals (draft time
    # of steps in which nobody drafted, e.g. the prefill, belongs to no request).
    mine = [o.metrics.spec for o in outs]
    assert all(m.draft_seconds > 0 and m.target_seconds > 0 for m in mine)
    seconds = engine.speculation.seconds
    assert 0.5 * seconds["draft"] < sum(m.draft_seconds for m in mine)
    assert sum(m.draft_seconds for m in mine) <= seconds["draft"]
    assert sum(m.target_seconds for m in mine) == pytest.approx(seconds["verify"])


# ---- forced tokens (the grammar hook) -------------------------------------------------------
class ReplayForcer:
    """Forces the next `m` tokens of each prompt's plain greedy output (every other step), or,
    when `wrong`, a token the target never picks there: a stand-in for a grammar's forced
    tokens, right or wrong."""

    def __init__(self, reference: dict[tuple, list[int]], m: int, wrong: bool = False):
        self.reference, self.m, self.wrong = reference, m, wrong

    def applies_to(self, request) -> bool:
        return True

    def forced_tokens(self, request, limit: int) -> list[int]:
        done = request.num_output_tokens
        if done % 2:
            return []
        ref = self.reference[tuple(request.prompt_token_ids)][done : done + min(self.m, limit)]
        return [(t + 1) % 256 for t in ref] if self.wrong else ref


@pytest.mark.parametrize("method", [None, "ngram", "draft"])
@pytest.mark.parametrize("wrong", [False, True])
def test_forced_tokens_ride_as_free_drafts(tiny_llama, draft_model, reference, method, wrong):
    ps, chosen = params()[:24], prompts()[:24]
    by_prompt = {tuple(p): ref for p, ref in zip(chosen, reference[:24], strict=True)}
    args = {} if method is None else spec_args(method, tiny_llama, draft_model)
    llm = LLM(str(tiny_llama), num_kv_blocks=256, num_speculative_tokens=2, **args)
    llm.engine.speculation.force_with(ReplayForcer(by_prompt, m=3, wrong=wrong))
    outs = llm.generate(chosen, ps, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference[:24]
    stats = llm.engine.speculation.stats
    assert stats.num_forced > 24
    assert stats.num_forced_accepted == (0 if wrong else stats.num_forced)
    assert sum(o.metrics.spec.num_forced for o in outs) == stats.num_forced
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]
    if method is None:  # nothing but forced tokens was drafted
        assert stats.num_drafts == stats.num_forced
