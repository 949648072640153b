"""engine/entrypoints/reasoning.py and the chat answers built from it (responses.py): the split
of a known token sequence into reasoning_content and content, whole and streamed token by token
(the same split), the rule's cases (open in the prompt, no thinking, cut off while thinking,
partial tags), tool calls after the thinking, and --reasoning-parser's choice."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.entrypoints import reasoning
from engine.entrypoints.openai.responses import ResponseContext, choice
from engine.entrypoints.reasoning import ReasoningParser, split
from engine.outputs import CompletionOutput, RequestOutput

ANSWER = "<think>\nThe user adds 2 and 2.\nThat is 4.\n</think>\n\nThe answer is 4."


@pytest.fixture(scope="module")
def tokenizer(thinking_qwen3):
    return AutoTokenizer.from_pretrained(thinking_qwen3)


def streamed(pieces: list[str], starts_open: bool) -> tuple[str, str]:
    """(reasoning, content) joined from a parser fed piece by piece, the last marked finished."""
    parser, thought, content = ReasoningParser(starts_open), "", ""
    for i, piece in enumerate(pieces):
        delta = parser.feed(piece, finished=i == len(pieces) - 1)
        thought, content = thought + delta.reasoning, content + delta.content
    return thought, content


def token_pieces(tokenizer, text: str) -> tuple[list[int], list[str]]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids, [tokenizer.decode([i]) for i in ids]


def test_known_token_sequence_splits_the_same_whole_and_streamed(tokenizer):
    """Qwen3's tags are single tokens; the answer's 55 tokens split into the thinking (without
    its surrounding newlines) and the answer (without the blank line), whole and streamed."""
    ids, pieces = token_pieces(tokenizer, ANSWER)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<think>") == 259
    assert ids.count(260) == 1 and len(ids) == 55
    want = ("The user adds 2 and 2.\nThat is 4.", "The answer is 4.")
    assert split(tokenizer.decode(ids), starts_open=False) == want
    assert streamed(pieces, starts_open=False) == want
    # The prompt opened the thinking (DeepSeek-R1's template): the output starts inside it.
    body = ANSWER.removeprefix("<think>")
    assert split(body, starts_open=True) == want
    assert streamed(token_pieces(tokenizer, body)[1], starts_open=True) == want


@pytest.mark.parametrize(
    "text, starts_open, want",
    [
        ("Just an answer.", False, (None, "Just an answer.")),  # no thinking: all content
        ("  \n<think>a</think>b", False, ("a", "b")),  # whitespace before the tag
        ("x <think>a</think>b", False, (None, "x <think>a</think>b")),  # a later tag is text
        ("<think>\nstill going", False, ("still going", None)),  # cut off while thinking
        ("still going</thi", True, ("still going</thi", None)),  # a partial tag at the end
        ("<thi", False, (None, "<thi")),  # the answer ended before the tag was complete
        ("<think>\n\n</think>\n\nHi", False, (None, "Hi")),  # empty thinking: none
        ("a</think></think>b", True, ("a", "</think>b")),  # only the first tag closes
        ("", True, (None, None)),
    ],
)
def test_the_rule_whole_and_streamed_by_characters(text, starts_open, want):
    assert split(text, starts_open) == want
    thought, content = streamed(list(text) or [""], starts_open)
    assert (thought or None, content or None) == want


def test_prompt_leaves_open(tokenizer):
    def leaves_open(text: str) -> bool:
        return reasoning.prompt_leaves_open(tokenizer, tokenizer.encode(text))

    assert leaves_open("<|im_start|>assistant\n<think>\n")
    assert not leaves_open("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not leaves_open("<|im_start|>assistant\n")


def test_parser_choice():
    qwen3_like, plain = "... '<think>\\n' ...", "{{ messages }}"
    assert reasoning.parser_enabled("auto", qwen3_like)
    assert not reasoning.parser_enabled("auto", plain) and not reasoning.parser_enabled(
        "auto", None
    )
    assert reasoning.parser_enabled("qwen3", plain) and reasoning.parser_enabled(
        "deepseek_r1", None
    )
    assert not reasoning.parser_enabled("none", qwen3_like)
    with pytest.raises(ValueError, match="reasoning parser must be one of"):
        reasoning.parser_enabled("granite", plain)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def chat_choices(text: str, pieces: list[str], tools: bool, starts_open: bool = False):
    """The whole answer's choice, and the stream's deltas for the same text in pieces."""

    def ctx() -> ResponseContext:
        return ResponseContext("chat", "m", tools=tools, starts_in_reasoning=starts_open)

    def out(piece: str, finish: str | None) -> RequestOutput:
        c = CompletionOutput(0, piece, [], finish_reason=finish)
        return RequestOutput("r", None, [1], [c], finished=finish is not None)

    whole = choice(ctx(), 0, out(text, "stop").outputs[0], False, out(text, "stop"))
    stream, deltas = ctx(), []
    for i, piece in enumerate(pieces):
        o = out(piece, "stop" if i == len(pieces) - 1 else None)
        deltas.append(choice(stream, 0, o.outputs[0], True, o))
    return whole, deltas


def test_tool_calls_after_thinking_parse_whole_and_streamed():
    """The thinking goes to reasoning_content, the call after it is parsed from the content
    part (finish_reason tool_calls); the stream's reasoning, name and arguments add up to the
    same."""
    text = "<think>\nI should look it up.\n</think>\n\n" + CALL
    whole, deltas = chat_choices(text, [text[i : i + 3] for i in range(0, len(text), 3)], True)
    message = whole["message"]
    assert message["reasoning_content"] == "I should look it up."
    assert message["content"] is None and whole["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    pieces = [d["delta"] for d in deltas]
    assert "".join(p.get("reasoning_content", "") for p in pieces) == "I should look it up."
    assert "".join(p.get("content", "") for p in pieces) == ""
    calls = [c for p in pieces for c in p.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    args = "".join(c["function"].get("arguments", "") for c in calls)
    assert args == '{"city": "Paris"}' and deltas[-1]["finish_reason"] == "tool_calls"


def test_answers_without_thinking_have_null_reasoning():
    whole, deltas = chat_choices("Hello there", ["Hel", "lo ", "there"], tools=False)
    assert whole["message"] == {
        "role": "assistant",
        "content": "Hello there",
        "reasoning_content": None,
    }
    assert [d["delta"] for d in deltas] == [
        {"content": "Hel"},
        {"content": "lo "},
        {"content": "there"},
    ]
    # Servers whose template does not think keep the answer's shape as it was.
    plain = ResponseContext("chat", "m")
    c = CompletionOutput(0, "<think>x</think>y", [], finish_reason="stop")
    out = RequestOutput("r", None, [1], [c], finished=True)
    assert choice(plain, 0, c, False, out)["message"] == {"role": "assistant", "content": c.text}
