"""Grammar-constrained decoding: constraint checks, compile errors and timeouts, and mask
soundness on a synthetic vocabulary. The engine with constraints and speculation is in
test_grammar_speculation.py; validity of sampled outputs on a real model in
test_grammar_validity.py.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
import xgrammar as xgr
from grammar_cases import CONSTRAINTS, assert_idle

from engine import LLM, SamplingParams
from engine.grammar import StructuredOutputs
from engine.grammar.compiler import GrammarCompiler, check_schema
from engine.grammar.matcher import GrammarManager, single_token
from engine.request import Request


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
        ({"structural_tag": "[1]"}, "structural_tag must be a structural tag object"),
        ({"structural_tag": "{x"}, "structural_tag is not valid JSON"),
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
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "x"}}}, "structural_tag: "),
    (  # the schemas inside a tag are checked like the json kind's
        {
            "structural_tag": {
                "type": "structural_tag",
                "format": {"type": "json_schema", "json_schema": {"not": {"type": "string"}}},
            }
        },
        "unsupported at #: 'not'",
    ),
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
