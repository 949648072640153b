"""Constraints, prompts and speculative engines shared by the grammar tests."""

from __future__ import annotations

import random

from engine import LLM, SamplingParams
from engine.grammar import StructuredOutputs

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
