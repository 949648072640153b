"""Grammar-constrained decoding in the engine with tiny random models (byte-level tokenizer):
speculation (forced tokens, n-gram, draft models) leaves constrained greedy output unchanged,
matchers follow only accepted tokens and are released on finish, abort and preemption."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr
from grammar_cases import CONSTRAINTS, assert_idle, params, prompts, spec_llm

from engine import LLM, SamplingParams
from engine.grammar import StructuredOutputs


# ---- the engine: speculation leaves constrained output unchanged -------------------------
@pytest.mark.parametrize("method", ["forced", "ngram", "draft", "self", "quantized-self"])
def test_speculation_keeps_constrained_greedy_output(tiny_llama, draft_model, reference, method):
    llm = spec_llm(method, tiny_llama, draft_model, num_kv_blocks=512)
    outs = llm.generate(prompts(36), params(36), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.engine.speculation.stats
    assert stats.num_forced > 100 and stats.num_forced_accepted > 0
    if method == "self":
        assert stats.num_accepted == stats.num_drafts
    if method == "quantized-self":
        assert stats.num_accepted > 0.5 * stats.num_drafts > 0, stats.as_dict()
    if method in ("draft", "self", "quantized-self"):  # drafts only what the grammar allows
        assert llm.engine.grammar.num_drafts_cut == 0
    per_request = [o.metrics.spec for o in outs]
    assert sum(s.num_forced for s in per_request) == stats.num_forced
    assert sum(s.num_drafts for s in per_request) == stats.num_drafts
    assert_idle(llm)


def test_unmasked_draft_model_would_propose_invalid_tokens(tiny_llama, draft_model, reference):
    """The broken variant of the check above: without its mask the draft model proposes
    tokens the grammar refuses (they are cut, so output stays right)."""
    llm = spec_llm("draft", tiny_llama, draft_model, num_kv_blocks=512)
    llm.engine.compile_constraint(CONSTRAINTS[0])  # makes the grammar manager
    llm.engine.speculation.proposer.logits_masker = None
    outs = llm.generate(prompts(36), params(36), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.grammar.num_drafts_cut > 0


def test_ngram_drafts_that_break_the_grammar_are_cut(tiny_llama, draft_model):
    """The prompt shows JSON with the schema's keys but values it forbids: prompt lookup
    proposes them, the grammar cuts them before verification, the output is unchanged."""
    example = '{"customer_full_name": "Bartholomew", "order_identifier": 123456, "items": ["fig"]}'
    prompt = list((example * 3).encode())
    p = SamplingParams(temperature=0, max_tokens=80, structured_outputs=CONSTRAINTS[0])
    plain = LLM(str(tiny_llama), num_kv_blocks=64, grammar_forced_tokens=False)
    want = plain.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    llm = spec_llm("ngram", tiny_llama, draft_model, num_kv_blocks=64)
    got = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    assert llm.engine.grammar.num_drafts_cut > 0
    assert_idle(llm)


def test_matcher_state_equals_feeding_only_accepted_tokens(tiny_llama, draft_model):
    """After every step (rejections on most of them), each live matcher gives the same mask and
    jump-forward string as a fresh matcher fed the request's output tokens."""
    llm = spec_llm("draft", tiny_llama, draft_model, num_kv_blocks=512)
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts(12), params(12), strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    vocab = engine.vocab_size
    ours, fresh = xgr.allocate_token_bitmask(1, vocab), xgr.allocate_token_bitmask(1, vocab)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            if request.grammar is None or not request.grammar.is_live:
                continue
            matcher = request.grammar.matcher(request.output_token_ids)
            replay = xgr.GrammarMatcher(request.grammar.compiled)
            assert all(replay.accept_token(t) for t in request.output_token_ids)
            matcher.fill_next_token_bitmask(ours)
            replay.fill_next_token_bitmask(fresh)
            assert torch.equal(ours, fresh)
            assert matcher.find_jump_forward_string() == replay.find_jump_forward_string()
            checked += 1
    stats = engine.speculation.stats
    assert checked > 50 and stats.num_accepted < stats.num_drafts
    assert_idle(llm)


def test_preemption_releases_matchers_and_replays(tiny_llama, draft_model, reference):
    llm = spec_llm("ngram", tiny_llama, draft_model, num_kv_blocks=24, max_num_seqs=36)
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts(36), params(36), strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        live = sum(r.grammar is not None and r.grammar.is_live for r in engine.scheduler.waiting)
        assert live == 0, "a preempted request kept its matcher"
        assert engine.grammar.num_matchers <= len(engine.scheduler.running)
    assert engine.scheduler.num_preemptions > 0
    assert [outs[f"r{i}"] for i in range(36)] == reference
    assert_idle(llm)


def test_abort_mid_run_releases_everything(tiny_llama, draft_model):
    llm = spec_llm("ngram", tiny_llama, draft_model, num_kv_blocks=256)
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts(18), params(18, n=2), strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    for _ in range(5):
        engine.step()
    assert engine.grammar.num_matchers > 0
    engine.abort_request([f"r{i}" for i in range(18)])
    assert_idle(llm)


def test_every_completion_of_n_is_constrained_and_grammar_end_stops(tiny_llama):
    """n > 1 sampled completions each follow the grammar; a finished grammar stops the request
    even with ignore_eos, and min_tokens cannot push past a grammar that must end."""
    llm = LLM(str(tiny_llama), num_kv_blocks=256)
    choice = StructuredOutputs(choice=["alpha", "beta", "gamma delta"])
    p = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=30, structured_outputs=choice)
    (out,) = llm.generate([[70, 71, 72]], p, use_tqdm=False)
    assert all(c.text in choice.choice and c.finish_reason == "stop" for c in out.outputs)
    for extra in ({"ignore_eos": True}, {"min_tokens": 20}):
        p = SamplingParams(temperature=0, max_tokens=30, structured_outputs=choice, **extra)
        (out,) = llm.generate([[70, 71, 72]], p, use_tqdm=False)
        assert out.outputs[0].text in choice.choice and out.outputs[0].finish_reason == "stop"
    assert_idle(llm)


def test_snapshot_reports_constraints(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    engine = llm.engine
    engine.add_request("c", [65], SamplingParams(max_tokens=30, structured_outputs=CONSTRAINTS[2]))
    engine.add_request("u", [66], SamplingParams(max_tokens=30))
    engine.step()
    engine.step()
    snap = engine.snapshot()
    kinds = {r["request_id"]: r["constraint"] for r in snap["requests"]}
    assert kinds == {"c": "regex", "u": None}
    assert snap["grammar"]["num_matchers"] == 1 and snap["grammar"]["compiled"] == 1
    engine.abort_request(["c", "u"])
    assert_idle(llm)
