"""Reasoning models over HTTP with the official `openai` client, on a tiny random Qwen3 with
Qwen3's real chat template (--reasoning-parser auto finds its `<think>`): reasoning_content
whole and streamed (the same split, and the split of the engine's own tokens), enable_thinking
false (no reasoning), reasoning_effort's rule, thinking_token_budget and llama.cpp's
thinking_budget_tokens, a tool call after the thinking, and the parser off."""

from __future__ import annotations

import httpx
import openai
import pytest
from web import tiny_serving

from engine.entrypoints.llm import chat_prompt_ids

TOOL_CALL = 261  # `<tool_call>` in models.make_thinking_qwen3
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
# Continuing an assistant message that opened `<think>`: the prompt leaves the thinking open
# (as DeepSeek-R1's template does), so the answer starts inside it.
THINKING = [*ASK, {"role": "assistant", "content": "<think>\n"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def server(thinking_qwen3):
    with tiny_serving(thinking_qwen3) as (url, state):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        yield client, state


def chat(client, messages=THINKING, **kw):
    extra = kw.pop("extra_body", {}) | (CONTINUE if messages is THINKING else {})
    args = dict(model="tiny", messages=messages, max_tokens=20, temperature=0) | kw
    return client.chat.completions.create(**args, extra_body=extra)


def streamed(client, **kw) -> tuple[str, str, list]:
    reasoning, content, calls = "", "", []
    for chunk in chat(client, stream=True, **kw):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
    return reasoning, content, calls


def raw_text(client, state, messages, template: dict, **extra) -> str:
    """The same answer unsplit: /v1/completions on the chat prompt's token ids."""
    ids = chat_prompt_ids(state.tokenizer, messages, **template)
    args = dict(model="tiny", prompt=ids, max_tokens=20, temperature=0)
    return client.completions.create(**args, extra_body=extra).choices[0].text


def test_reasoning_content_whole_and_streamed(server):
    """The answer starts inside the thinking and this model never closes it: all of it is
    reasoning_content (stripped), none content; the stream says the same."""
    client, _ = server
    message = chat(client).choices[0].message
    assert message.reasoning_content and message.content is None
    assert streamed(client)[:2] == (message.reasoning_content, "")


def test_thinking_budget_splits_at_the_closing_tag(server):
    """thinking_token_budget 6: `</think>` after 6 tokens; the reasoning is the text before it,
    the content the text after it (of the same tokens, unsplit by /v1/completions); whole,
    streamed and llama.cpp's name agree."""
    client, state = server
    budget = {"thinking_token_budget": 6}
    message = chat(client, extra_body=budget).choices[0].message
    text = raw_text(client, state, THINKING, CONTINUE, **budget)
    thought, content = text.split("</think>", 1)
    assert message.reasoning_content == thought.strip() and thought.strip()
    assert message.content == (content.lstrip() or None)
    want = (message.reasoning_content, message.content or "")
    assert streamed(client, extra_body=budget)[:2] == want
    llama = chat(client, extra_body={"thinking_budget_tokens": 6}).choices[0].message
    assert (llama.reasoning_content, llama.content) == (want[0], message.content)
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        chat(client, extra_body={"thinking_token_budget": -2})
    with pytest.raises(openai.BadRequestError, match="disagree"):
        chat(client, extra_body=budget | {"thinking_budget_tokens": 5})


def test_enable_thinking_false_gives_no_reasoning(server):
    """Qwen3's template closes an empty thinking block in the prompt: the whole answer is
    content, reasoning_content null; reasoning_effort "none" renders the same prompt."""
    client, state = server
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    message = chat(client, ASK, extra_body=off).choices[0].message
    text = raw_text(client, state, ASK, {"template_kwargs": {"enable_thinking": False}})
    assert message.reasoning_content is None and message.content == text
    none = chat(client, ASK, reasoning_effort="none").choices[0].message
    assert (none.reasoning_content, none.content) == (None, message.content)
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        chat(client, ASK, extra_body={"reasoning_effort": "extreme"})
    # /tokenize renders the same prompts: "none" is enable_thinking false, others a variable
    # Qwen3's template does not read; chat_template_kwargs win over the effort.
    url = str(client.base_url).removesuffix("/").removesuffix("/v1") + "/tokenize"

    def tokens(**body) -> list[int]:
        return httpx.post(url, json={"messages": ASK, **body}).json()["tokens"]

    assert tokens(reasoning_effort="none") == tokens(**off) != tokens()
    assert tokens(reasoning_effort="high") == tokens()
    both = {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}
    assert tokens(**both) == tokens()


def test_tool_call_after_the_thinking(server):
    """thinking_token_budget 0 closes the thinking at once; then the model (a logit bias on
    `<tool_call>`) calls the tool, its arguments held to the schema by tool_choice auto's
    grammar: parsed from the content part, whole and streamed."""
    client, _ = server
    extra = {"thinking_token_budget": 0, "logit_bias": {str(TOOL_CALL): 100}}
    extra["parallel_tool_calls"] = False
    response = chat(client, tools=[WEATHER], max_tokens=60, extra_body=extra)
    choice = response.choices[0]
    assert choice.message.reasoning_content is None and choice.message.tool_calls
    assert choice.message.tool_calls[0].function.name == "get_weather"
    _, _, calls = streamed(client, tools=[WEATHER], max_tokens=60, extra_body=extra)
    assert calls[0].function.name == "get_weather"
    args = "".join(c.function.arguments or "" for c in calls if c.index == 0)
    assert args == choice.message.tool_calls[0].function.arguments


def test_parser_none_leaves_the_text_as_it_is(thinking_qwen3):
    with tiny_serving(thinking_qwen3, reasoning_parser="none") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        message = chat(client, extra_body={"thinking_token_budget": 2}).choices[0].message
        assert "</think>" in message.content
        assert getattr(message, "reasoning_content", None) is None
