"""Constrained sampling on SmolLM2-135M at temperature 1.0, many seeds: every output that
finished by stop is valid (jsonschema with format checks, re.fullmatch, choice membership, the
EBNF's own parse), every output cut by max_tokens is an accepted prefix; the same requests
without the masks produce invalid output (so the check can fail). Grammar-forced tokens ride as
drafts (the engine's default), so these outputs also went through verification.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr

from engine import LLM, SamplingParams
from engine.grammar import StructuredOutputs

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 2, "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "address"],
}
SCHEMAS = {
    "nested": PERSON,
    "array_of_enums": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue"]},
        "minItems": 1,
        "maxItems": 4,
    },
    "any_of": {
        "anyOf": [
            {"type": "integer", "minimum": -5, "maximum": 5},
            {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        ]
    },
    "ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "formats": {
        "type": "object",
        "properties": {
            "email": {"type": "string", "format": "email"},
            "day": {"type": "string", "format": "date"},
            "host": {"type": "string", "format": "ipv4"},
        },
        "required": ["email", "day", "host"],
    },
    "lengths": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 2, "maxLength": 4},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["code", "tags"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 100},
            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
            "note": {"type": ["string", "null"], "maxLength": 10},
        },
        "required": ["price", "qty", "note"],
    },
}
REGEXES = [r"[A-Z][a-z]{2,8}", r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{5,20}\.", r"[0-9a-f]{8}"]
CHOICES = [["Paris", "London", "Berlin"], ["positive", "negative", "neutral"]]


def is_arithmetic(text: str) -> bool:
    """expr ::= term (("+" | "-") term)*; term ::= [0-9]+ | "(" expr ")" (recursive descent)."""

    def expr(i: int) -> int | None:
        i = term(i)
        while i is not None and i < len(text) and text[i] in "+-":
            i = term(i + 1)
        return i

    def term(i: int) -> int | None:
        if i < len(text) and text[i] == "(":
            j = expr(i + 1)
            return j + 1 if j is not None and j < len(text) and text[j] == ")" else None
        j = i
        while j < len(text) and text[j].isdigit():
            j += 1
        return j if j > i else None

    return expr(0) == len(text)


# name: (grammar, an independent checker)
EBNF = {
    "arith": (
        'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"',
        is_arithmetic,
    ),
    "words": (
        'root ::= word (", " word){0,3}\nword ::= [a-z]{2,8}',
        lambda t: re.fullmatch(r"[a-z]{2,8}(, [a-z]{2,8}){0,3}", t) is not None,
    ),
    "pairs": (
        'root ::= pair (";" pair)*\npair ::= [a-z]+ "=" [0-9]+',
        lambda t: re.fullmatch(r"[a-z]+=[0-9]+(;[a-z]+=[0-9]+)*", t) is not None,
    ),
}
SEEDS = 5


def corpus() -> list[tuple[str, StructuredOutputs, str]]:
    """(name, constraint, user message)."""
    items = [
        (f"json:{k}", StructuredOutputs(json=s), f"Answer in JSON: an example {k}.")
        for k, s in SCHEMAS.items()
    ]
    items.append(("json_object", StructuredOutputs(json_object=True), "Describe a cat in JSON."))
    items += [(f"regex:{r}", StructuredOutputs(regex=r), "Give a short answer.") for r in REGEXES]
    items += [(f"choice:{c[0]}", StructuredOutputs(choice=c), "Pick one.") for c in CHOICES]
    items += [
        (f"ebnf:{k}", StructuredOutputs(grammar=g), "Write one line.") for k, (g, _) in EBNF.items()
    ]
    return items


def is_valid(name: str, so: StructuredOutputs, text: str) -> bool:
    kind = so.kind
    if kind in ("json", "json_object"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        validator = jsonschema.Draft202012Validator(
            so.schema, format_checker=jsonschema.FormatChecker()
        )
        return validator.is_valid(value)
    if kind == "regex":
        return re.fullmatch(so.regex, text) is not None
    if kind == "choice":
        return text in so.choice
    return EBNF[name.split(":")[1]][1](text)


@pytest.fixture(scope="module")
def smollm():
    """The exact weights: the validity counts and token equalities below were calibrated on them
    (quantized weights sample other texts, and resolve bf16 near-ties differently in a
    verification step than in a decode step)."""
    return LLM("smollm2-135m-instruct", quantization=None, num_kv_blocks=768, max_num_seqs=128)


def run(llm: LLM, items, seeds: int):
    prompts, params = [], []
    for _, so, message in items:
        prompt = llm.apply_chat_template([{"role": "user", "content": message}])
        for seed in range(seeds):
            prompts.append(prompt)
            params.append(
                SamplingParams(temperature=1.0, seed=seed, max_tokens=64, structured_outputs=so)
            )
    return llm.generate(prompts, params, use_tqdm=False)


def test_sampled_outputs_are_valid(smollm):
    items = corpus()
    outs = run(smollm, items, SEEDS)
    finished, problems = {}, []
    for i, out in enumerate(outs):
        name, so, _ = items[i // SEEDS]
        c = out.outputs[0]
        if c.finish_reason == "stop":
            finished[name] = finished.get(name, 0) + 1
            if not is_valid(name, so, c.text):
                problems.append(f"{name} seed {i % SEEDS}: invalid {c.text!r}")
        else:  # cut by max_tokens: the grammar must still accept every token
            assert c.finish_reason == "length"
            matcher = xgr.GrammarMatcher(smollm.engine.compile_constraint(so))
            if not all(matcher.accept_token(t) for t in c.token_ids):
                problems.append(f"{name} seed {i % SEEDS}: not a prefix {c.text!r}")
    assert not problems, "\n".join(problems)
    # Non-vacuous: most requests finish (a margin for other CPUs sampling other tokens), and
    # every kind finishes somewhere.
    assert sum(finished.values()) >= 0.6 * len(outs), finished  # 70/85 finish on our box
    for kind in ("json:", "json_object", "regex:", "choice:", "ebnf:"):
        assert any(name.startswith(kind) for name in finished), (kind, finished)
    snap = smollm.engine.snapshot()
    assert snap["grammar"]["num_matchers"] == 0
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_without_masks_the_same_requests_are_invalid(smollm):
    """The broken variant: the engine with its logits mask switched off (forced tokens off too,
    they come from the grammar) fails the same validity check."""
    llm = LLM(
        "smollm2-135m-instruct", quantization=None, num_kv_blocks=256, grammar_forced_tokens=False
    )
    llm.engine.compile_constraint(StructuredOutputs(choice=["x"]))  # makes the grammar manager
    llm.engine.runner.logits_masker = None
    llm.engine.grammar.commit = lambda request, token: False  # nothing checks the tokens
    items = [it for it in corpus() if it[0].startswith(("regex:", "choice:", "json:nested"))]
    outs = run(llm, items, 2)
    invalid = sum(
        not is_valid(items[i // 2][0], items[i // 2][1], o.outputs[0].text)
        for i, o in enumerate(outs)
    )
    assert invalid >= len(outs) // 2


def test_greedy_with_forced_tokens_and_ngram_equals_plain_constrained(smollm):
    """On the real tokenizer (multi-byte tokens: jump-forward strings are re-tokenized and may
    split differently from the model's choice), speculation leaves constrained greedy output
    unchanged, token for token."""
    items = corpus()
    prompts = [smollm.apply_chat_template([{"role": "user", "content": m}]) for _, _, m in items]
    params = [
        SamplingParams(temperature=0, max_tokens=64, structured_outputs=so) for _, so, _ in items
    ]
    plain = LLM(
        "smollm2-135m-instruct", quantization=None, num_kv_blocks=256, grammar_forced_tokens=False
    )
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(
        "smollm2-135m-instruct", quantization=None, num_kv_blocks=256, speculative_method="ngram"
    )
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = spec.engine.speculation.stats
    assert stats.num_forced_accepted > 0.2 * sum(len(t) for t in want)
    assert stats.num_forced_accepted < stats.num_forced  # some re-tokenized forced drafts fail
    snap = spec.engine.snapshot()
    assert snap["grammar"]["num_matchers"] == 0
    assert snap["num_free_blocks"] == snap["num_blocks"]
