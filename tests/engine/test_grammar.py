"""Grammar-constrained decoding: constraint checks, compile errors and timeouts, mask soundness
on a synthetic vocabulary, and the engine with tiny random models (byte-level tokenizer):
speculation (forced tokens, n-gram, draft models) leaves constrained greedy output unchanged,
matchers follow only accepted tokens and are released on finish, abort and preemption.

Validity of sampled outputs on a real model is in test_grammar_validity.py.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch
import xgrammar as xgr

from engine import LLM, SamplingParams
from engine.grammar import StructuredOutputs
from engine.grammar.compiler import GrammarCompiler, check_schema
from engine.grammar.matcher import GrammarManager, single_token
from engine.request import Request

# Long fixed keys: the grammar forces most of the output.
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 8},
        "order_identifier": {"type": "integer", "minimum": 0, "maximum": 999},
        "express_delivery": {"type": "boolean"},
        "items": {"type": "array", "items": {"enum": ["apple", "pear"]}, "maxItems": 3},
    },
    "required": ["customer_full_name", "order_identifier", "express_delivery", "items"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    StructuredOutputs(json=ORDER_SCHEMA),
    StructuredOutputs(json_object=True),
    StructuredOutputs(regex=r"(ab|cd)[0-9]{2,6}-(x|yz)"),
    StructuredOutputs(choice=["alpha", "beta", "gamma delta"]),
    StructuredOutputs(grammar='root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'),
    None,  # unconstrained requests share the batch
]


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(1)
    out = []
    for i in range(n):
        phrase = [rng.randrange(32, 127) for _ in range(rng.randint(2, 6))]
        out.append((phrase * 6)[: rng.randint(4, 30)] if i % 2 else phrase)
    return out


def params(count: int, **kw) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0,
            max_tokens=40 + i % 13,
            structured_outputs=CONSTRAINTS[i % len(CONSTRAINTS)],
            **kw,
        )
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Constrained greedy without any speculation: no proposer, no forced tokens."""
    llm = LLM(str(tiny_llama), num_kv_blocks=512, grammar_forced_tokens=False)
    outs = llm.generate(prompts(36), params(36), use_tqdm=False)
    assert llm.engine.speculation.stats.num_drafts == 0
    return [o.outputs[0].token_ids for o in outs]


def assert_idle(llm) -> None:
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"], "blocks leaked"
    assert snap["grammar"]["num_matchers"] == 0, "matchers leaked"


SPEC = {
    "forced": {},
    "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3},
    "draft": {"num_speculative_tokens": 3},  # another random model: most drafts rejected
    "self": {"num_speculative_tokens": 4},  # the target itself: every draft accepted
    # the target's own weights in int8 draft for it (draft_model="self")
    "quantized-self": {"num_speculative_tokens": 4, "draft_quantization": "int8"},
}


def spec_llm(method, tiny_llama, draft_model, **kw) -> LLM:
    args = dict(SPEC[method])
    if method in ("draft", "self"):
        args["draft_model"] = str(draft_model if method == "draft" else tiny_llama)
        args["draft_quantization"] = None
    if method == "quantized-self":
        args["draft_model"] = "self"
    return LLM(str(tiny_llama), adaptive_speculation=False, **args, **kw)


# ---- constraints and compilation --------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": [1, 2]}, "must be a JSON schema object"),
        ({"json_object": "yes"}, "json_object must be True"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"grammar": 5}, "grammar must be a non-empty string"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", ""]}, "choice must be a non-empty list"),
        ({"regex": "a", "any_whitespace": "no"}, "any_whitespace must be a bool"),
    ],
)
def test_constraint_shape_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**kwargs)
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=kwargs)


def test_constraint_from_dict_and_key():
    p = SamplingParams(structured_outputs={"json": '{"type": "integer"}'})
    assert p.structured_outputs.json == {"type": "integer"}
    a = StructuredOutputs(json={"a": 1, "b": 2}).key
    assert a == StructuredOutputs(json='{"b": 2, "a": 1}').key  # canonical: key order ignored
    assert a != StructuredOutputs(json={"a": 1, "b": 2}, any_whitespace=True).key
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"regexp": "a"})


BAD_CONSTRAINTS = [
    ({"json": {"type": "strin"}}, 'structured_outputs.json: Unsupported type "strin"'),
    ({"json": {"$ref": "#/$defs/nope"}}, "structured_outputs.json: .*\\$defs"),
    ({"json": {"$ref": "https://example.com/s.json"}}, "only local \\$ref"),
    ({"json": {"not": {"type": "string"}}}, "unsupported at #: 'not'"),
    (
        {"json": {"type": "object", "properties": {"a": {"if": {}, "then": {}}}}},
        "unsupported at #/properties/a: 'if'",
    ),
    ({"json": {"type": "array", "uniqueItems": True}}, "'uniqueItems'"),
    ({"json": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "'oneOf' with several"),
    ({"json": {"allOf": [{"type": "object"}, {"required": ["a"]}]}}, "'allOf' with several"),
    ({"json": {"dependentRequired": {"a": ["b"]}}}, "'dependentRequired'"),
    ({"json": {"type": "string", "pattern": "^(?=a)b$"}}, "pattern .*Lookahead"),
    ({"json": {"type": "string", "pattern": "[a-z]+", "minLength": 2}}, "'pattern' together"),
    ({"json": {"type": "string", "format": "email", "maxLength": 9}}, "'format' together"),
    ({"json": {"type": "integer", "minimum": 2.5}}, "structured_outputs.json: Integer"),
    ({"regex": "a(b"}, "structured_outputs.regex: Regex parsing error .*parenthesis"),
    ({"regex": "(?<=a)b"}, "structured_outputs.regex: .*Lookbehind"),
    ({"regex": r"(a)\1"}, "structured_outputs.regex: .*Backreference"),
    ({"grammar": "root ::= foo"}, 'structured_outputs.grammar: .*Rule "foo" is not defined'),
    ({"grammar": 'root := "a"'}, "structured_outputs.grammar: .*Unexpected character"),
]


@pytest.mark.parametrize("kwargs, message", BAD_CONSTRAINTS)
def test_bad_constraints_raise_and_the_engine_keeps_serving(tiny_llama, kwargs, message):
    llm = _shared_llm(tiny_llama)
    bad = SamplingParams(temperature=0, max_tokens=8, structured_outputs=kwargs)
    with pytest.raises(ValueError, match=message) as info:
        llm.engine.add_request("bad", [65, 66], bad)
    assert "/project/" not in str(info.value) and ".cc:" not in str(info.value)  # no C++ paths
    assert not llm.engine.has_unfinished_requests()
    good = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["ok!"]})
    (out,) = llm.generate([[65, 66]], good, use_tqdm=False)
    assert out.outputs[0].text == "ok!" and out.outputs[0].finish_reason == "stop"
    assert_idle(llm)


_LLMS: dict = {}


def _shared_llm(path) -> LLM:
    if path not in _LLMS:
        _LLMS[path] = LLM(str(path), num_kv_blocks=64)
    return _LLMS[path]


def big_schema(n: int = 60) -> dict:
    props = {f"field_{i}": {"type": "string", "pattern": "[a-z]{3,9}-[0-9]{2,5}"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def test_compile_timeout_is_a_clear_error(tiny_llama):
    # ~80 ms to compile on the 2-core AMD box (60 fields took 9.4 ms there: too close to a
    # 10 ms limit), against a 1 ms limit.
    llm = LLM(str(tiny_llama), num_kv_blocks=64, grammar_compile_timeout=0.001)
    p = SamplingParams(structured_outputs={"json": big_schema(400)})
    with pytest.raises(ValueError, match="structured_outputs.json: compiling took longer than"):
        llm.engine.add_request("slow", [65], p)
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate([[65]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    assert_idle(llm)


def test_compiles_off_the_engine_loop_and_are_cached(tiny_llama):
    """A submitting thread compiles (xgrammar releases the GIL) while the loop keeps stepping;
    the same constraint again is a cache hit."""
    llm = LLM(str(tiny_llama), num_kv_blocks=64)
    engine = llm.engine
    engine.add_request("runner", [65, 66], SamplingParams(temperature=0, max_tokens=400))
    so = StructuredOutputs(json=big_schema(80))
    thread = threading.Thread(target=engine.compile_constraint, args=(so,))
    engine.step()
    steps, t0 = 0, time.perf_counter()
    thread.start()
    while thread.is_alive():
        engine.step()
        steps += 1
    compile_seconds = time.perf_counter() - t0
    snap = engine.snapshot()["grammar"]
    assert snap["compiled"] == 1 and snap["cache_size"] == 1
    assert steps >= 3, f"only {steps} engine steps during a {compile_seconds:.2f} s compile"
    engine.add_request("constrained", [65], SamplingParams(max_tokens=4, structured_outputs=so))
    assert engine.snapshot()["grammar"]["cache_hits"] == 1
    engine.abort_request(["runner", "constrained"])
    assert_idle(llm)


def test_compile_cache_is_bounded_lru(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=64, grammar_cache_size=2)
    for choice in ("a", "b", "a", "c", "a", "b"):
        llm.engine.compile_constraint(StructuredOutputs(choice=[choice]))
    compiler = llm.engine.grammar.compiler
    # a, b compiled; a hit; c evicts b (a was used last); a hit; b compiled again.
    assert (compiler.num_compiled, compiler.num_hits, compiler.cache_len) == (4, 2, 2)


def test_check_schema_walks_subschemas_not_data():
    # A property *named* "not", and enum/const data that looks like keywords, are fine.
    check_schema(
        {
            "type": "object",
            "properties": {"not": {"type": "string"}, "if": {"enum": [{"not": 1}]}},
            "$defs": {"x": {"const": {"oneOf": [1, 2]}}},
        }
    )
    with pytest.raises(ValueError, match="#/\\$defs/x/items/0"):
        check_schema({"$defs": {"x": {"type": "array", "items": [{"not": {}}]}}})


FORMAT_CASES = {
    "ipv4": [
        "0.0.0.0",
        "255.255.255.255",
        "80.0.237.0",
        "10.20.30.40",
        "80.0.237.000",  # a sampled answer once: xgrammar's own rule admits leading zeros
        "01.2.3.4",
        "1.2.3.04",
        "256.1.1.1",
        "1.2.3",
    ],
    "date": [
        "2023-02-17",
        "2023-01-31",
        "2024-02-29",  # leap years: divisible by 4, centuries by 400
        "2000-02-29",
        "0004-02-29",
        "9999-12-31",
        "0001-01-01",
        "2023-02-30",  # xgrammar's own rule admits these
        "2023-04-31",
        "2023-02-29",
        "1900-02-29",
        "0000-01-01",
        "2023-13-01",
        "2023-00-10",
        "2023-06-00",
    ],
}


@pytest.mark.parametrize("fmt", FORMAT_CASES)
def test_formats_admit_what_jsonschema_accepts(synthetic, fmt):
    """Formats xgrammar's own rules get wrong compile from strict patterns (FORMAT_PATTERNS):
    the grammar takes exactly the strings jsonschema's format checker takes."""
    import json

    import jsonschema

    compiler, _, _ = synthetic
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}}
    schema["required"] = ["v"]
    compiled = compiler.compile(StructuredOutputs(json=schema))
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    admitted, valid = [], []
    for value in FORMAT_CASES[fmt]:
        matcher = xgr.GrammarMatcher(compiled)
        admitted.append(matcher.accept_string(json.dumps({"v": value})) and matcher.is_completed())
        valid.append(checker.is_valid({"v": value}))
    assert admitted == valid, list(zip(FORMAT_CASES[fmt], admitted, valid, strict=True))
    assert 0 < valid.count(True) < len(valid)  # the cases cover both answers


# ---- mask soundness on a synthetic vocabulary -------------------------------------------
SYNTHETIC_VOCAB = (
    [chr(c) for c in range(32, 127)]
    + ['{"', '":', '", "', ": ", ", ", "ab", "abc", "true", "false", "null", "12", "345", "]}"]
    + ['"key"', "pear", "apple", " + ", "(1", "9)", "-x", "yz", "\n", "\\n", '\\"', "é"]
    + ["<eos>"]
)


@pytest.fixture(scope="module")
def synthetic():
    eos = len(SYNTHETIC_VOCAB) - 1
    info = xgr.TokenizerInfo(SYNTHETIC_VOCAB, stop_token_ids=[eos])
    compiler = GrammarCompiler(info)
    manager = GrammarManager(compiler, tokenizer=None, vocab_size=len(SYNTHETIC_VOCAB), max_rows=8)
    manager.jump_forward = False  # no HF tokenizer to encode jump-forward strings
    return compiler, manager, eos


def allowed_by_brute_force(matcher: xgr.GrammarMatcher, vocab: int) -> set[int]:
    allowed = set()
    for token in range(vocab):
        probe = matcher.fork()
        if probe.accept_token(token):
            allowed.add(token)
    return allowed


@pytest.mark.parametrize("constraint", CONSTRAINTS[:5], ids=lambda c: c.kind)
def test_masks_are_exactly_the_allowed_tokens(synthetic, constraint):
    """Random walks: every mask row equals brute force over the vocabulary (sound and
    complete), is never empty, and the token chosen from masked random logits is accepted."""
    compiler, manager, eos = synthetic
    compiled = compiler.compile(constraint)
    vocab = len(SYNTHETIC_VOCAB)
    rng = torch.Generator().manual_seed(0)
    for walk in range(6):
        request = Request(f"w{walk}", [0], SamplingParams(), {eos}, 10_000)
        manager.attach(request, compiled, constraint.kind)
        for _ in range(40):
            matcher = request.grammar.matcher(request.output_token_ids)
            want = allowed_by_brute_force(matcher, vocab)
            assert want, "the grammar left nothing to emit"
            logits = torch.randn(1, vocab, generator=rng) * 3
            manager.mask(logits, [(request, [])])
            assert set(torch.isfinite(logits[0]).nonzero()[:, 0].tolist()) == want
            token = int(logits.argmax())
            request.append_token(token)
            if manager.commit(request, token):
                assert token == eos
                break
        request.grammar.release()
    assert manager.num_matchers == 0


def test_span_masks_follow_the_drafts_and_roll_back(synthetic):
    """One verification span: row j is masked by the state after drafts[:j]; afterwards the
    matcher is back where it was (its mask and accepted count unchanged)."""
    compiler, manager, eos = synthetic
    so = CONSTRAINTS[0]
    compiled = compiler.compile(so)
    request = Request("span", [0], SamplingParams(), {eos}, 10_000)
    manager.attach(request, compiled, so.kind)
    text = '{"customer_full_name": "ab", "order_identifier": 12'
    prefix, drafts = [SYNTHETIC_VOCAB.index(ch) for ch in text[:20]], []
    for ch in text[20:]:
        drafts.append(SYNTHETIC_VOCAB.index(ch))
    for t in prefix:
        request.append_token(t)
        manager.commit(request, t)
    before = torch.zeros(1, len(SYNTHETIC_VOCAB))
    manager.mask(before, [(request, [])])
    rows = [(request, drafts[:j]) for j in range(len(drafts) + 1)]
    logits = torch.zeros(len(rows), len(SYNTHETIC_VOCAB))
    manager.mask(logits, rows)
    for j in range(len(rows)):
        fresh = xgr.GrammarMatcher(compiled)
        for t in prefix + drafts[:j]:
            assert fresh.accept_token(t)
        want = allowed_by_brute_force(fresh, len(SYNTHETIC_VOCAB))
        assert set(torch.isfinite(logits[j]).nonzero()[:, 0].tolist()) == want
    after = torch.zeros(1, len(SYNTHETIC_VOCAB))
    manager.mask(after, [(request, [])])
    assert torch.equal(before, after)
    assert manager.valid_prefix(request, drafts + [eos, 5]) == len(drafts)  # '5' breaks it
    request.grammar.release()


def test_single_token_reads_one_set_bit():
    row = np.zeros(4, dtype=np.int32)
    assert single_token(row) is None
    row[2] = 1 << 5
    assert single_token(row) == 2 * 32 + 5
    row[2] = np.int32(-(2**31))  # bit 31
    assert single_token(row) == 2 * 32 + 31
    row[3] = 1
    assert single_token(row) is None
    row[3], row[2] = 0, 3
    assert single_token(row) is None


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
