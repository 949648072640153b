"""Faults inside one request's processing fail that request alone: the detokenizer, the grammar
(forced tokens, draft checks, masks, commits) raising for one request ends it with
finish_reason "error" and a message without internals, while every other request in the same
steps produces exactly what it produces alone, every block returns to the pool, no matcher is
left live, and the engine keeps serving. NaN logits (an adapter whose weights are NaN) end that
request alone too, and none of its blocks is ever found in the prefix cache."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

PROMPTS = [[5 + i for i in range(30)], [7, 8, 9, 7, 8, 9, 7, 8], [3, 4], list(range(40, 60))]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
VICTIM = 1  # the request the fault hits


class Boom(RuntimeError):
    pass


def alone(llm: LLM, prompts, params) -> list[list[int]]:
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def run_with_fault(llm: LLM, prompts, params, arm) -> dict:
    """Submit every prompt, arm the fault on the victim once it exists, step to the end."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    arm(engine, engine.groups[f"r{VICTIM}"])
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def check_isolated(llm: LLM, finals: dict, want: list[list[int]], words: str) -> None:
    victim = finals[f"r{VICTIM}"]
    assert victim.outputs[0].finish_reason == "error"
    assert words in victim.error and "Traceback" not in victim.error and "/" not in victim.error
    for i, expected in enumerate(want):
        if i != VICTIM:
            out = finals[f"r{i}"].outputs[0]
            assert out.token_ids == expected and out.finish_reason == "length", i
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]
    assert snap["num_request_errors"] == 1
    # Still serving: the victim's prompt alone now gives its usual output.
    assert alone(llm, [PROMPTS[VICTIM]], PARAMS) == [want[VICTIM]]


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_detokenizer_fault_fails_one_request(tiny_llama, spec):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, max_num_batched_tokens=16, speculative_method=spec)
    want = alone(llm, PROMPTS, PARAMS)

    def arm(engine, group):
        detok = group.detokenizers[0]
        calls = {"n": 0}
        real = detok.add_token

        def add_token(token, may_stop):
            calls["n"] += 1
            if calls["n"] == 3:
                raise Boom("injected detokenizer fault")
            return real(token, may_stop)

        detok.add_token = add_token

    finals = run_with_fault(llm, PROMPTS, PARAMS, arm)
    check_isolated(llm, finals, want, "detokeniz")
    assert len(finals[f"r{VICTIM}"].outputs[0].token_ids) == 3  # what it had when it failed


def test_n_greater_than_one_fails_the_whole_group(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    params = SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=8, ignore_eos=True)
    engine = llm.engine
    engine.add_request("g", PROMPTS[0], params)
    engine.add_request("other", PROMPTS[2], PARAMS)
    group = engine.groups["g"]

    def add_token(token, may_stop):
        raise Boom("injected")

    group.detokenizers[1].add_token = add_token
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert [c.finish_reason for c in finals["g"].outputs] == ["error"] * 3
    assert finals["other"].outputs[0].token_ids == alone(llm, [PROMPTS[2]], PARAMS)[0]
    snap = engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]


@pytest.mark.parametrize("where", ["commit", "mask", "forced_tokens", "valid_prefix"])
def test_grammar_fault_fails_one_request(tiny_llama, where):
    """A constrained victim among constrained and free requests, with n-gram drafts and forced
    tokens on, so every grammar entry point runs each step."""
    llm = LLM(
        str(tiny_llama),
        num_kv_blocks=64,
        max_num_batched_tokens=16,
        speculative_method="ngram",
        adaptive_speculation=False,
    )
    constrained = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, structured_outputs={"regex": "[a-z]{3,40}"}
    )
    params = [constrained, constrained, PARAMS, PARAMS]
    want = [
        llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
        for p, sp in zip(PROMPTS, params, strict=True)
    ]
    engine = llm.engine
    grammar = engine.grammar
    real = getattr(grammar, where)
    victim = f"r{VICTIM}"

    def faulty(*args):
        requests = [a for a in args if hasattr(a, "request_id")]
        rows = args[1] if where == "mask" else []
        requests += [r for r, _ in rows]
        if any(r.request_id == victim for r in requests) and engine.num_steps >= 2:
            raise Boom(f"injected grammar fault in {where}")
        return real(*args)

    setattr(grammar, where, faulty)
    if where == "mask":
        engine.runner.logits_masker = faulty
    for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    setattr(grammar, where, real)
    if where == "mask":
        engine.runner.logits_masker = real
    out = finals[victim]
    assert out.outputs[0].finish_reason == "error" and "grammar" in out.error
    for i in (0, 2, 3):
        assert finals[f"r{i}"].outputs[0].token_ids == want[i], i
    snap = engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]
    assert snap["grammar"]["num_matchers"] == 0


def test_constraint_dead_end_is_the_requests_own_error(tiny_llama):
    """A grammar with no output at all is refused at submission; one that dead-ends after a
    prefix ends that request mid-generation as a client error (error_status 400), others on."""
    llm = LLM(str(tiny_llama), num_kv_blocks=64, speculative_method="ngram")
    for empty in ({"grammar": "root ::= x\nx ::= x"}, {"regex": "[^\\x00-\\U0010FFFF]"}):
        with pytest.raises(ValueError, match="admits no output at all"):
            llm.generate(["hi"], SamplingParams(structured_outputs=empty), use_tqdm=False)
    dead_end = SamplingParams(
        temperature=0, max_tokens=8, structured_outputs={"grammar": 'root ::= "ab" x\nx ::= x'}
    )
    want = alone(llm, [PROMPTS[0]], PARAMS)[0]
    bad, good = llm.generate([PROMPTS[1], PROMPTS[0]], [dead_end, PARAMS], use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and bad.error_status == 400
    assert "dead end" in bad.error
    assert good.outputs[0].token_ids == want and good.error is None
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"] and snap["grammar"]["num_matchers"] == 0


@pytest.fixture(scope="module")
def nan_adapter(tiny_llama, tmp_path_factory):
    """A PEFT adapter for the tiny model whose q_proj B matrices are NaN: a corrupt file a real
    deployment could be handed (the loader checks shapes and names, not values)."""
    from safetensors.torch import load_file, save_file

    from lora import LoRARequest
    from models import make_adapter

    path = make_adapter(tiny_llama, tmp_path_factory.mktemp("nan") / "nan", 3, 4, ["q_proj"], {})
    weights_file = path / "adapter_model.safetensors"
    weights = load_file(str(weights_file))
    for name in weights:
        if "lora_B" in name:
            weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(weights_file))
    return LoRARequest("nan", str(path))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_end_one_request_and_never_enter_the_cache(tiny_llama, nan_adapter, temperature):
    """The victim is served a NaN adapter: every logit of its rows is NaN. It alone ends with
    finish_reason "error" (greedy: the argmax path; 0.8: the sampling path), the others in the
    same steps finish with exactly their tokens alone, and none of its blocks enter the prefix
    cache: the same prompt with the same adapter again finds no cached token, while a healthy
    request's second run does (non-vacuous). Without the NaN check the victim "finishes" with
    12 tokens of garbage (NaN's argmax) and finish_reason "length"; without the uncaching its
    second run finds 32 cached tokens of NaN K/V."""
    llm = LLM(str(tiny_llama), num_kv_blocks=64, max_num_batched_tokens=32, enable_lora=True)
    prompts = [*PROMPTS[:VICTIM], list(range(100, 140)), *PROMPTS[VICTIM + 1 :]]
    want = alone(llm, prompts, PARAMS)
    victim_params = SamplingParams(temperature=temperature, seed=5, max_tokens=12, ignore_eos=True)
    engine = llm.engine
    for i, p in enumerate(prompts):
        if i == VICTIM:
            engine.add_request(f"r{i}", p, victim_params, lora_request=nan_adapter)
        else:
            engine.add_request(f"r{i}", p, PARAMS)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    victim = finals[f"r{VICTIM}"]
    assert victim.outputs[0].finish_reason == "error", victim.outputs[0]
    assert "not a number" in victim.error and victim.error_status == 500
    for i, expected in enumerate(want):
        if i != VICTIM:
            out = finals[f"r{i}"].outputs[0]
            assert out.token_ids == expected and out.finish_reason == "length", i
    snap = engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"] and snap["num_request_errors"] == 1
    (again,) = llm.generate(
        [prompts[VICTIM]], victim_params, use_tqdm=False, lora_request=nan_adapter
    )
    assert again.num_cached_tokens == 0 and again.outputs[0].finish_reason == "error"
    (healthy,) = llm.generate([prompts[0]], PARAMS, use_tqdm=False)
    assert healthy.num_cached_tokens == 16 and healthy.outputs[0].token_ids == want[0]
