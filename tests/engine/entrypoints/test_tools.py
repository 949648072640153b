"""Tool calling: request checks, the Hermes-format parser (whole and streamed), prompt rendering
with and without a template that knows tools, and constrained calls that always validate."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tools_cases import ADD_TOOL as ADD
from tools_cases import SCHEMAS, TOOLS

from engine import LLM, SamplingParams
from engine.entrypoints.tools import ToolCallParser, Tools, parse_tool_calls, render_messages
from engine.errors import ParamError


@pytest.mark.parametrize(
    "kwargs, param, message",
    [
        ({"tools": "x"}, "tools", "tools must be a list"),
        ({"tools": []}, "tools", "tools must be a list of 1 to 128"),
        ({"tools": [{"type": "retrieval"}]}, "tools", r"tools\[0\]: must be"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "name must"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools",
            r"tools\[0\]: function.parameters must be a JSON schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]},
            "tools",
            "'not' cannot be enforced",
        ),
        ({"tools": [ADD, ADD]}, "tools", "same name"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be one of"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "tool_choice",
            "must name one of the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a bool"),
    ],
)
def test_bad_tools_name_the_field(kwargs, param, message):
    with pytest.raises(ParamError, match=message) as err:
        Tools.parse(**kwargs)
    assert err.value.param == param


def test_tool_choice_defaults_and_forms():
    assert Tools.parse() is None and Tools.parse(tool_choice="none") is None
    assert Tools.parse(TOOLS).choice == "auto"
    named = Tools.parse(TOOLS, {"type": "function", "function": {"name": "add"}}, False)
    assert named.choice == {"type": "function", "function": {"name": "add"}}
    assert named.parallel is False and named.names == ("get_weather", "add")
    assert Tools.parse(TOOLS, "none").constraint() is None
    assert Tools.parse(TOOLS, "none").in_prompt is None
    tag = Tools.parse(TOOLS, "required").constraint().structural_tag["format"]
    assert tag["type"] == "tags_with_separator" and tag["at_least_one"]
    assert [t["begin"] for t in tag["tags"]] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '<tool_call>\n{"name": "add", "arguments": ',
    ]
    with pytest.raises(ParamError, match="cannot be combined") as err:
        Tools.parse(TOOLS, "required").apply(SamplingParams(structured_outputs={"regex": "a"}))
    assert err.value.param == "tool_choice"


TEXT = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "n": [1, {"a": "]}"}]}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)


def test_parser_reads_content_and_calls():
    content, calls = parse_tool_calls(TEXT)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Pa"ris}', "n": [1, {"a": "]}"}]}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_tool_calls("no calls here\n") == ("no calls here\n", [])
    # A call whose arguments are not an object stays text; a cut-off call keeps what it has.
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": 3}') == (
        '<tool_call>\n{"name": "f", "arguments": 3}',
        [],
    )
    odd = '<tool_call>\n{"name": "a\\qb", "arguments": {}}'  # not a JSON string: text
    assert parse_tool_calls(odd) == (odd, [])
    _, cut = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"x": [1, ')
    assert [(c.name, c.arguments) for c in cut] == [("f", '{"x": [1, ')]


@pytest.mark.parametrize("step", [1, 2, 7])
def test_streamed_pieces_add_up_to_the_whole(step):
    """Fed a few characters at a time: the content never shows a partial `<tool_call>`, each
    call's id and name come in its first entry, and the argument fragments join to the whole
    parse's arguments."""
    parser = ToolCallParser()
    content, calls = "", {}
    for end in [*range(step, len(TEXT), step), len(TEXT)]:
        delta = parser.feed(TEXT[:end])
        content += delta.content
        assert "<" not in content
        for entry in delta.calls:
            call = calls.setdefault(entry["index"], {"args": ""})
            if "id" in entry:
                assert len(call) == 1 and entry["function"]["arguments"] == ""
                call.update(id=entry["id"], name=entry["function"]["name"])
            call["args"] += entry["function"]["arguments"]
    content += parser.finish().content
    whole = parser.tool_calls
    assert content == parser.content == "Let me look."
    assert [(c["id"], c["name"], c["args"]) for c in calls.values()] == [
        (c.id, c.name, c.arguments) for c in whole
    ]
    # Without a call, text held back as a possible `<tool_call>` is content after all.
    parser = ToolCallParser()
    assert parser.feed("a <tool_ca").content == "a"
    assert parser.finish().content == " <tool_ca"


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2 + 40?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a":2,"b":40}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
    {"role": "tool", "tool_call_id": "c2", "content": "ok"},
]


def test_render_for_a_template_without_tools():
    """SmolLM2's template knows no tools: instructions join the system message, calls become
    the assistant's text, adjacent results one user message."""
    out = render_messages(HISTORY, [ADD], knows_tools=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert json.dumps(ADD) in out[0]["content"]
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'
    )
    assert out[3] == {
        "role": "user",
        "content": "<tool_response>\n42\n</tool_response>\n<tool_response>\nok\n</tool_response>",
    }
    # A template that knows tools gets the messages, arguments as objects (it writes tojson).
    native = render_messages(HISTORY, [ADD], knows_tools=True)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 40}
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"] == '{"a":2,"b":40}'
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]
    with pytest.raises(ParamError, match=r"messages\[0\].tool_calls\[0\].function.arguments"):
        render_messages(bad, None, knows_tools=True)


@pytest.fixture(scope="module")
def smollm():
    return LLM("smollm2-135m-instruct", quantization=None, num_kv_blocks=512, max_num_seqs=64)


ASK = [{"role": "user", "content": "What is the weather in Nice for the next 2 days, and 7+8?"}]
SEEDS = 24


def sampled_calls(llm: LLM, tool_choice, parallel=True):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=96) for s in range(SEEDS)]
    outs = llm.chat(
        [ASK] * SEEDS,
        params,
        use_tqdm=False,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
    )
    return [o.outputs[0] for o in outs]


def invalid_calls(completions) -> list[str]:
    """Every completion must hold at least one call, each of a known function with arguments
    that validate against its schema (the last call of one cut by max_tokens may be partial)."""
    problems = []
    for i, c in enumerate(completions):
        _, calls = parse_tool_calls(c.text)
        if not calls:
            problems.append(f"seed {i}: no call in {c.text!r}")
        if c.finish_reason == "length":
            calls = calls[:-1]
        for call in calls:
            try:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            except (KeyError, ValueError, jsonschema.ValidationError) as e:
                problems.append(f"seed {i}: {call.name} {call.arguments!r}: {e!s:.80}")
    return problems


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_always_validate(smollm, parallel):
    completions = sampled_calls(smollm, "required", parallel)
    assert not invalid_calls(completions)
    # Non-vacuous: many finish (a small model chains calls until max_tokens otherwise; 12 of
    # 24 finish with parallel calls here, all without).
    assert sum(c.finish_reason == "stop" for c in completions) >= SEEDS // 3
    counts = [len(c.tool_calls) for c in completions]
    if parallel:
        assert max(counts) > 1  # the model does call twice; finished texts hold only calls
    else:
        assert counts == [1] * SEEDS
    for c in completions:
        if c.finish_reason == "stop":
            assert parse_tool_calls(c.text)[0] is None
    assert {c.tool_calls[0].name for c in completions} == {"get_weather", "add"}
    snap = smollm.engine.snapshot()
    assert snap["grammar"]["num_matchers"] == 0 and snap["num_free_blocks"] == snap["num_blocks"]


def test_named_choice_calls_that_function(smollm):
    completions = sampled_calls(smollm, {"type": "function", "function": {"name": "get_weather"}})
    assert not invalid_calls(completions)
    assert all([c.name for c in x.tool_calls] == ["get_weather"] for x in completions)
    # Compact JSON, as the json kind writes it (xgrammar's own tag format admits any spacing).
    args = [json.loads(x.tool_calls[0].arguments) for x in completions]
    assert [x.tool_calls[0].arguments for x in completions] == [json.dumps(a) for a in args]
    # The call's opening is forced by the grammar: free drafts, not sampled tokens.
    assert all(c.token_kinds.count("f") >= 10 for c in completions)


def test_without_masks_the_same_calls_are_invalid():
    """The broken variant: the grammar's masks off (and its forced tokens), the same requests
    fail the same check."""
    llm = LLM(
        "smollm2-135m-instruct", quantization=None, num_kv_blocks=512, grammar_forced_tokens=False
    )
    llm.engine.compile_constraint(Tools.parse(TOOLS, "required").constraint())
    llm.engine.runner.logits_masker = None
    llm.engine.grammar.commit = lambda request, token: False  # nothing checks the tokens
    assert len(invalid_calls(sampled_calls(llm, "required"))) >= SEEDS // 2


@pytest.mark.slow
def test_qwen_template_renders_tools_and_calls_validate():
    """Qwen2.5's own template knows tools: the history's call renders with its arguments as an
    object (a JSON string would come out quoted twice), results as <tool_response>; its
    required calls validate."""
    llm = LLM("qwen2.5-coder-0.5b-instruct", num_kv_blocks=256)
    text = llm.tokenizer.decode(llm.apply_chat_template(HISTORY, tools=[ADD]))
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>' in text
    assert "<tool_response>\n42\n</tool_response>\n<tool_response>\nok\n</tool_response>" in text
    assert json.dumps(ADD) in text and text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    completions = sampled_calls(llm, "required", parallel=False)
    assert not invalid_calls(completions)
