"""Predicted Outputs (spec.prediction): the cursor that keeps a prediction in step with the output,
and the engine's outputs with a prediction equal to its outputs without one, token for token,
greedy and seeded, beside grammar, LoRA, n-gram and per-request k; the usage counters exact; steps
of up to 31 prediction drafts (more than a proposer's 15), rolled back exactly under a grammar.

The reference is the same engine without any speculation (itself held to HF transformers by
test_parity); a verifier that accepts every draft must fail the same comparison.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine import LLM, SamplingParams, step_results
from engine.entrypoints.llm import chat_prompt_ids
from engine.errors import ParamError
from engine.grammar import matcher as grammar_matcher
from engine.rejection import VerifyResult, VerifyRow
from kernels import reference as kernels_reference
from lora.adapter import LoRARequest
from models import make_adapter
from spec.prediction import MAX_PREDICTION_TOKENS, Prediction, prediction_ids

P = list(range(100, 160))  # a prediction of 60 distinct tokens


# ---- the cursor ------------------------------------------------------------------------------
def test_drafts_start_at_the_prediction_and_follow_the_output():
    p = Prediction(P)
    assert p.drafts([], [], 5) == P[:5]
    assert p.drafts(P[:3], [], 5) == P[3:8]
    assert p.drafts(P[:10], [], 4) == P[10:14]  # more output since: followed in one go
    assert p.drafts(P[:58], [], 5) == P[58:]  # the end of the prediction
    assert p.drafts(P, [], 5) == []


def test_an_edit_realigns_forward_tentatively_then_confirmed():
    p = Prediction(P)
    out = P[:10] + [7]  # a substitution at position 10
    assert p.drafts(out, [], 15) == []  # 7 occurs nowhere in the prediction
    out += [P[11]]  # the edit is over: the output is the prediction again
    assert p.drafts(out, [], 15) == P[12:14]  # a match of 1 token: 2 drafts
    q = Prediction(P)
    assert q.drafts(out + [P[12]], [], 15) == P[13:17]  # 2 tokens (seen at once): 4 drafts
    out += [P[12]]  # the next token confirms p's match: the full limit again
    assert p.drafts(out, [], 15) == P[13:28]


def test_a_deletion_skips_ahead_and_an_insertion_resumes():
    p = Prediction(P)
    assert p.drafts(P[:10] + P[30:32], [], 3) == P[32:35]
    q = Prediction(P)
    assert q.drafts(P[:10] + [1, 2, 3], [], 3) == []
    assert q.drafts(P[:10] + [1, 2, 3] + P[10:12], [], 3) == P[12:15]


def test_the_first_match_at_or_after_the_cursor_wins():
    line = [1, 2, 3, 4]
    pred = line + [50, 51] + line + [60, 61] + line + [70, 71]
    p = Prediction(pred)
    # In step through the first line and 50, 51; then 9 instead of the second line's start.
    out = line + [50, 51, 9] + line[1:]
    # Ahead of the cursor (6) the second line (end 9) and the third (end 15) match 2, 3, 4:
    # the first of them; the first line, behind the cursor, is not considered.
    assert p.drafts(out, [], 2) == [60, 61]


def test_a_repeat_goes_back_only_on_two_matching_tokens():
    p = Prediction(P)
    assert p.drafts(P[:20] + [P[5]], [], 3) == []  # one token behind the cursor: no match
    assert p.drafts(P[:20] + [P[5], P[6]], [], 3) == P[7:10]


def test_forced_tokens_come_first_and_must_continue_the_prediction():
    p = Prediction(P)
    assert p.drafts(P[:4], P[4:6], 3) == P[6:9]
    assert p.drafts(P[:4], [7], 3) == []


def test_bad_predictions_name_the_parameter():
    class Tokenizer:
        def encode(self, text, add_special_tokens):
            assert not add_special_tokens
            return [ord(c) for c in text]

    tok = Tokenizer()
    assert prediction_ids("ab", tok, 320) == [97, 98]
    assert prediction_ids([1, 2], tok, 320) == [1, 2]
    assert prediction_ids(None, tok, 320) is None
    for bad, why in [
        ({"type": "content"}, "must be a string or a list of token ids in [0, 320)"),
        ([1, "2"], "must be a string"),
        ([1, 320], "in [0, 320)"),
        ([True], "must be a string"),
        ("x" * (MAX_PREDICTION_TOKENS + 1), f"at most {MAX_PREDICTION_TOKENS}"),
    ]:
        with pytest.raises(ParamError, match=r"prediction") as info:
            prediction_ids(bad, tok, 320)
        assert info.value.param == "prediction" and why in str(info.value)


# ---- through the engine ----------------------------------------------------------------------
NUM_PROMPTS = 12
MAX_TOKENS = 60


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(256) for _ in range(rng.randint(3, 20))] for _ in range(NUM_PROMPTS)]


def predictions(outputs: list[list[int]]) -> list[list[int] | str]:
    """Per prompt: the output itself, edited (substituted, inserted, deleted, truncated), an
    unrelated one (another prompt's output), or text."""
    out = []
    for i, tokens in enumerate(outputs):
        kind = i % 6
        if kind == 0:
            out.append(list(tokens))
        elif kind == 1:
            out.append(tokens[:20] + [1, 2, 3] + tokens[21:])
        elif kind == 2:
            out.append(tokens[:15] + [4, 5, 6, 7] + tokens[15:])
        elif kind == 3:
            out.append(tokens[:10] + tokens[25:])
        elif kind == 4:
            out.append(outputs[(i + 1) % len(outputs)])
        else:
            out.append("def f(x):\n    return x + 1\n" * 3)
    return out


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def with_predictions(params: list[SamplingParams], outputs) -> list[SamplingParams]:
    return [
        SamplingParams(**{**vars(p), "prediction": pred})
        for p, pred in zip(params, predictions(outputs), strict=True)
    ]


def generate(llm, params, **kw) -> list:
    outs = llm.generate(prompts(), params, use_tqdm=False, **kw)
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"], "blocks leaked"
    return outs


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama):
    """An engine without any speculation, and its greedy outputs."""
    llm = LLM(str(tiny_llama), num_kv_blocks=512)
    return llm, tokens(generate(llm, [greedy()] * NUM_PROMPTS))


def test_greedy_outputs_equal_and_counts_exact(plain):
    llm, want = plain
    outs = generate(llm, with_predictions([greedy()] * NUM_PROMPTS, want))
    assert tokens(outs) == want
    spec = [o.metrics.spec for o in outs]
    # The output as its prediction: 1 token from the prompt's step, then the other 59 in steps
    # of 31 drafts + 1 (nothing drafted past max_tokens): 2 steps, 57 drafts, all accepted.
    assert (spec[0].num_predicted, spec[0].num_predicted_accepted, spec[0].num_steps) == (57, 57, 2)
    assert outs[0].outputs[0].token_kinds == "p" + "a" * 31 + "b" + "a" * 26 + "b"
    assert spec[0].drafted_at == [2] * 26 + [1] * 5 and spec[0].accepted_at == spec[0].drafted_at
    # Edits (drafted, accepted): the rejections where the edit is, the rest of the copy
    # accepted; another prompt's output and unrelated text: mostly rejected, the output equal.
    counts = [(s.num_predicted, s.num_predicted_accepted) for s in spec[:6]]
    assert counts == [(57, 57), (68, 54), (72, 55), (72, 41), (30, 0), (8, 0)], counts
    assert llm.engine.speculation.stats.num_predicted == sum(s.num_predicted for s in spec)


def test_seeded_sampling_equal(plain, tiny_llama):
    llm, _ = plain
    sampled = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i in range(NUM_PROMPTS)
    ]
    want = tokens(generate(llm, sampled))
    outs = generate(llm, with_predictions(sampled, want))
    assert tokens(outs) == want
    assert outs[0].metrics.spec.num_predicted_accepted == 57  # its own output: all accepted


def accept_every_draft(**kw) -> tuple[torch.Tensor, torch.Tensor]:
    """A broken verifier (the batched kernel, sampled requests): every draft is accepted, the
    bonus is the token the true verdict emits where it stops."""
    out, num_accepted = kernels_reference.rejection_verify(**kw)
    cu_rows, draft_ids = kw["cu_rows"].tolist(), kw["draft_ids"]
    for b in range(len(cu_rows) - 1):
        d = cu_rows[b + 1] - cu_rows[b] - 1
        bonus = out[b, num_accepted[b]].item()
        out[b, :d] = draft_ids[cu_rows[b] : cu_rows[b] + d]
        out[b, d], num_accepted[b] = bonus, d
    return out, num_accepted


def accept_every_greedy_draft(row: VerifyRow, argmax: list[int]) -> VerifyResult:
    """A broken verifier (greedy requests' argmax path): every draft is accepted."""
    return VerifyResult([*row.drafts, argmax[row.start + len(row.drafts)]], len(row.drafts))


@pytest.mark.parametrize("sampled", [False, True])
def test_a_verifier_that_accepts_every_prediction_draft_fails_the_comparison(
    tiny_llama, plain, monkeypatch, sampled
):
    llm = LLM(str(tiny_llama), num_kv_blocks=512)
    params = [greedy()] * NUM_PROMPTS
    if sampled:
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS) for i in range(12)]
    want = tokens(generate(llm, params))
    runner = llm.engine.runner
    runner.backend = dataclasses.replace(runner.backend, verify_kernel=accept_every_draft)
    monkeypatch.setattr(step_results, "verify_greedy", accept_every_greedy_draft)
    got = tokens(generate(llm, with_predictions(params, want)))
    assert got[0] == want[0]  # the exact prediction: nothing to tell
    assert [g == w for g, w in zip(got, want, strict=True)].count(False) >= 5


@pytest.mark.parametrize("k", [None, 0, 2])
def test_composes_with_ngram_and_per_request_k(tiny_llama, plain, k):
    _, want = plain
    llm = LLM(str(tiny_llama), num_kv_blocks=512, speculative_method="ngram")
    outs = generate(llm, with_predictions([greedy(num_speculative_tokens=k)] * NUM_PROMPTS, want))
    assert tokens(outs) == want
    assert outs[0].metrics.spec.num_predicted_accepted > 40


CONSTRAINTS = [
    {"regex": r"(ab|cd)[0-9]{2,6}-(x|yz) [a-z ]{10,40}"},
    {"json": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}}},
    {"choice": ["alpha", "beta", "gamma delta"]},
]


@pytest.mark.parametrize("forced", [True, False])
def test_with_grammar(tiny_llama, forced):
    """Constrained outputs equal with a prediction (the forced tokens, when they ride, first;
    the prediction's drafts then cut where the grammar refuses them)."""
    llm = LLM(str(tiny_llama), num_kv_blocks=512, grammar_forced_tokens=forced)
    params = [greedy(structured_outputs=CONSTRAINTS[i % 3]) for i in range(NUM_PROMPTS)]
    outs = generate(llm, params)
    want = tokens(outs)
    texts = [o.outputs[0].text for o in outs]
    edited = [t[:8] + "zz" + t[9:] for t in texts]
    late = [t[:20] + "zz" + t[21:] for t in texts]  # out of step after more than 15 drafts
    for preds in (want, texts, edited, late):
        params_p = [
            SamplingParams(**{**vars(p), "prediction": pred})
            for p, pred in zip(params, preds, strict=True)
        ]
        got = generate(llm, params_p)
        assert tokens(got) == want
    assert sum(o.metrics.spec.num_predicted_accepted for o in got) > 0


def test_with_lora(tiny_llama, plain, tmp_path):
    _, base = plain
    adapter = make_adapter(tiny_llama, tmp_path / "a", 7, 8, ["q_proj", "v_proj"], {})
    llm = LLM(str(tiny_llama), num_kv_blocks=512, enable_lora=True)
    lora = LoRARequest("a", str(adapter))
    want = tokens(generate(llm, [greedy()] * NUM_PROMPTS, lora_request=lora))
    assert want != base  # the adapter changes the outputs
    # The base model's outputs as predictions: rejected where the adapter differs.
    for preds in (want, base):
        params = [greedy(prediction=p) for p in preds]
        assert tokens(generate(llm, params, lora_request=lora)) == want


def test_n_siblings_each_follow_their_own_output(plain):
    llm, want = plain
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = llm.generate(prompts()[:1], params, use_tqdm=False)[0]
    first = alone.outputs[0].token_ids
    predicted = SamplingParams(**{**vars(params), "prediction": first})
    got = llm.generate(prompts()[:1], predicted, use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in alone.outputs]


def test_bad_prediction_is_refused_before_anything_runs(plain):
    llm, _ = plain
    with pytest.raises(ParamError, match="prediction must be") as info:
        llm.generate(prompts()[:1], greedy(prediction=[1, 10**6]), use_tqdm=False)
    assert info.value.param == "prediction"
    assert not llm.engine.has_unfinished_requests()


# ---- a thinking budget over a constraint: the budget's matcher keeps its own rollback states ---
OPEN = 259  # `<think>` (tests/models.py make_thinking_qwen3)
THINKING = {
    "thinking_token_budget": 30,
    "structured_outputs": {"regex": "[a-z]{30,40}</think>[a-z]{20,40}"},
}


@pytest.fixture(scope="module")
def thinking(thinking_qwen3):
    """A tiny Qwen3 with think tags, a prompt that opens the thinking, and its answer without a
    prediction under a budget of 30 over a regex."""
    llm = LLM(str(thinking_qwen3), num_kv_blocks=128, num_threads=1)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = chat_prompt_ids(llm.engine.tokenizer, messages, template_kwargs={"enable_thinking": True})
    ids.append(OPEN)
    params = SamplingParams(temperature=0, max_tokens=64, **THINKING)
    (out,) = llm.generate([ids], params, use_tqdm=False)
    return llm, ids, out.outputs[0]


def predicted(thinking, prediction: list[int]):
    llm, ids, _ = thinking
    params = SamplingParams(temperature=0, max_tokens=64, prediction=prediction, **THINKING)
    (out,) = llm.generate([ids], params, use_tqdm=False)
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"], "blocks leaked"
    return out.outputs[0]


def edited_at(tokens: list[int], at: int) -> list[int]:
    """tokens with the one at `at` replaced by another the regex allows there (a letter)."""
    return tokens[:at] + [next(t for t in tokens if t != tokens[at])] + tokens[at + 1 :]


def test_prediction_drafts_past_15_under_a_budget_and_a_constraint_equal(thinking):
    """Up to 31 drafts a step are walked by the draft check and the mask and rolled back,
    through the budget's matcher and xgrammar's under it: the output is the one without a
    prediction, for the answer itself (31 accepted in one step) and for one out of step at
    token 20 (the mismatch after 19 accepted drafts, then realigned)."""
    _, _, want = thinking
    close = want.token_ids.index(260)  # `</think>`, forced at the budget
    assert close == 30 and len(want.token_ids) == 56 and want.finish_reason == "stop"
    same = predicted(thinking, want.token_ids)
    assert same.token_ids == want.token_ids
    # 31 drafts (`</think>` among them), then the last 23 (the end of turn the last: no bonus).
    assert same.token_kinds == "p" + "a" * 31 + "b" + "a" * 23
    late = predicted(thinking, edited_at(want.token_ids, 20))
    assert late.token_ids == want.token_ids
    # 19 accepted, the edit rejected; realigned 2 tokens off in "ilil" (2 drafts, accepted),
    # out of step again at once, then realigned for good: 16 and the last 14.
    assert late.token_kinds == "p" + "a" * 19 + "r" + "aab" + "r" + "a" * 16 + "b" + "a" * 14


def test_matchers_that_roll_back_16_tokens_fail_it(thinking, monkeypatch):
    """The broken variant: matchers sized for a proposer's 15 drafts (16 tokens of rollback).
    The budget's matcher keeps 17 states: checking 31 drafts and rolling back pops past them,
    and the request fails at its first step with drafts, after the prompt's token."""
    monkeypatch.setattr(grammar_matcher, "MAX_ROLLBACK_TOKENS", 16)
    _, _, want = thinking
    for prediction in (want.token_ids, edited_at(want.token_ids, 20)):
        got = predicted(thinking, prediction)
        assert (got.finish_reason, got.token_ids) == ("error", want.token_ids[:1])
