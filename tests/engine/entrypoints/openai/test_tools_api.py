"""Tool calling and echo over HTTP, driven with the official `openai` client."""

from __future__ import annotations

import json

import jsonschema
from tools_cases import SCHEMAS, TOOLS
from web import wait_idle

from engine import SamplingParams

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "What is the weather in Nice for the next 2 days, and 7+8?"}]


def _call(i: int, city: str) -> dict:
    args = json.dumps({"city": city, "unit": "celsius", "days": 1})
    return {
        "id": f"c{i}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": args},
    }


# Two earlier turns that called the tool: SmolLM2 then writes a call of its own under `auto`.
FEW_SHOT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [_call(1, "Paris")]},
    {"role": "user", "content": "Weather in Lyon?"},
    {"role": "assistant", "content": None, "tool_calls": [_call(2, "Lyon")]},
    {"role": "user", "content": "Weather in Nice?"},
]


def streamed(client, **args):
    """A streamed answer put together as a client does: content, and per call index its id,
    name and joined argument fragments; the finish reasons."""
    content, calls, finishes = "", {}, []
    for chunk in client.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for entry in delta.tool_calls or []:
            if entry.index not in calls:  # the first entry of a call: its id and name
                assert entry.id and entry.type == "function" and entry.function.name
                calls[entry.index] = [entry.id, entry.function.name, ""]
            else:
                assert entry.id is None and entry.function.name is None
            calls[entry.index][2] += entry.function.arguments or ""
        if chunk.choices[0].finish_reason:
            finishes.append(chunk.choices[0].finish_reason)
    return content or None, [tuple(c) for c in calls.values()], finishes


def check_calls(message) -> list[tuple[str, dict]]:
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_tool_choice_forms_whole_streamed_and_offline(client, offline, smol):
    """required, a named function, auto and none: whole answers equal the offline API's
    (LLM.chat with the same tools) and the streamed pieces add up to the whole answer."""
    cases = [
        (ASK, "required", False),
        (ASK, {"type": "function", "function": {"name": "add"}}, True),
        (FEW_SHOT, "auto", True),
        (ASK, "none", True),
    ]
    for messages, choice, parallel in cases:
        args = dict(model=MODEL, messages=messages, max_tokens=64, temperature=0)
        args |= dict(tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
        whole = client.chat.completions.create(**args).choices[0]
        (ref,) = offline.chat(
            messages,
            SamplingParams(temperature=0, max_tokens=64),
            use_tqdm=False,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=parallel,
        )
        ref = ref.outputs[0]
        if choice == "none":
            assert whole.message.tool_calls is None and whole.finish_reason == "stop"
            assert whole.message.content == ref.text and "<tool_call>" not in ref.text
            assert ref.tool_calls == []
        else:
            names_args = check_calls(whole.message)
            assert names_args == [(t.name, json.loads(t.arguments)) for t in ref.tool_calls]
            assert whole.finish_reason == "tool_calls" and whole.message.content is None
        if choice == "required":
            assert [n for n, _ in names_args] == ["get_weather"]  # one call: not parallel
        if isinstance(choice, dict):
            assert [n for n, _ in names_args] == ["add"]
        if choice == "auto":
            assert names_args == [("get_weather", {"city": "Nice", "unit": "celsius", "days": 1})]
        content, calls, finishes = streamed(client, **args)
        assert content == whole.message.content
        assert [(n, a) for _, n, a in calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []
        ]
        assert finishes == [whole.finish_reason]
    snap = wait_idle(smol[1].engine)
    assert snap["num_free_blocks"] == snap["num_blocks"] and snap["grammar"]["num_matchers"] == 0


WEATHER = {"Nice": "21 C, sunny", "Paris": "18 C, cloudy", "Lyon": "15 C, rain"}


def test_two_turn_tool_loop(client, offline):
    """The client's loop: the model calls, the caller runs the function and sends the result
    back with the call in the history; the second answer is the offline API's for the same
    history (its prompt rendered the same way, token for token)."""
    messages = list(ASK)
    args = dict(model=MODEL, max_tokens=48, temperature=0, tools=TOOLS)
    first = client.chat.completions.create(
        messages=messages, tool_choice="required", parallel_tool_calls=False, **args
    )
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    city = json.loads(call.function.arguments).get("city", "Nice")
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": WEATHER[city]})
    second = client.chat.completions.create(messages=messages, tool_choice="none", **args)
    history = [ASK[0], first.choices[0].message.model_dump(), messages[-1]]
    (ref,) = offline.chat(history, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    assert second.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert second.choices[0].message.content == ref.outputs[0].text
    assert second.choices[0].message.tool_calls is None
    prompt = offline.tokenizer.decode(ref.prompt_token_ids)
    assert f"<tool_response>\n{WEATHER[city]}\n</tool_response>" in prompt
    assert f'"arguments": {json.dumps(json.loads(call.function.arguments))}' in prompt


def test_echo_with_prompt_logprobs(client, offline):
    """echo puts the prompt before the completion; with logprobs, the prompt's tokens come
    first (the first one's logprob null) and carry the offline API's prompt logprobs; with
    max_tokens 0, the prompt alone."""
    prompt = "The capital of France is"
    args = dict(model=MODEL, prompt=prompt, temperature=0, logprobs=2, echo=True)
    r = client.completions.create(max_tokens=3, **args).choices[0]
    (ref,) = offline.generate(
        prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2)
    )
    completion = ref.outputs[0]
    assert r.text == prompt + completion.text
    num_prompt = len(ref.prompt_token_ids)
    lps = r.logprobs
    assert len(lps.tokens) == num_prompt + len(completion.token_ids)
    assert "".join(lps.tokens) == r.text
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    want = [
        p[t].logprob for t, p in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:], strict=True)
    ]
    want += [p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs, strict=True)]
    assert lps.token_logprobs[1:] == want
    assert lps.text_offset == [len("".join(lps.tokens[:i])) for i in range(len(lps.tokens))]
    alone = client.completions.create(max_tokens=0, **args)
    assert alone.choices[0].text == prompt and alone.choices[0].finish_reason == "length"
    assert alone.choices[0].logprobs.token_logprobs == [None, *want[: num_prompt - 1]]
    assert alone.usage.completion_tokens == 0 and alone.usage.prompt_tokens == num_prompt
    chunks = list(client.completions.create(max_tokens=3, stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.text
    tokens = [
        lp
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert tokens == lps.token_logprobs
    offsets = [
        o
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for o in c.choices[0].logprobs.text_offset
    ]
    assert offsets == lps.text_offset  # absolute across chunks, as in the whole answer
