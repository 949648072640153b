"""Predicted Outputs over HTTP with the official `openai` client: the same answers with a
prediction as without one (greedy and seeded, chat and completions, streamed, with tools and an
adapter), usage's accepted and rejected prediction tokens, and the 400s for bad predictions.

Two servers: SmolLM2 on the default GGUF path with no speculative method (a prediction turns
speculation on for its request alone), and the package's fp32 server with n-gram speculation and
adapters (`client`).
"""

from __future__ import annotations

import openai
import pytest
from tools_cases import WEATHER_TOOL
from web import API_KEY, make_state, serving, wait_idle

from engine.entrypoints.openai.server import build_app
from spec.prediction import MAX_PREDICTION_TOKENS

MODEL = "smollm2-135m-instruct"
CODE = """def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)
"""
ASK = [
    {
        "role": "user",
        "content": "Rename the variable total to acc in this Python code. Answer with the "
        f"code only.\n\n```python\n{CODE}```",
    }
]


@pytest.fixture(scope="module")
def gguf_client():
    state = make_state(MODEL, num_kv_blocks=256, max_model_len=2048)
    with serving(build_app(state)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0), state
    state.engine.shutdown()


@pytest.fixture(params=["gguf", "fp32-ngram"])
def server(request, gguf_client, smol, client):
    if request.param == "gguf":
        return gguf_client
    return client, smol[1]


def chat(c, **kw):
    args = {"model": MODEL, "messages": ASK, "max_tokens": 80, "temperature": 0} | kw
    return c.chat.completions.create(**args)


def details(response) -> tuple[int, int]:
    d = response.usage.completion_tokens_details
    return d.accepted_prediction_tokens, d.rejected_prediction_tokens


def test_chat_answers_equal_and_usage_counts(server):
    c, state = server
    plain = chat(c)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # no prediction: no counts
    # The answer itself as the prediction: every draft accepted. The first token comes from
    # the prompt's step; the other m - 1 in steps of up to 31 drafts + 1.
    same = chat(c, prediction={"type": "content", "content": text})
    assert same.choices[0].message.content == text
    m = same.usage.completion_tokens
    assert m == plain.usage.completion_tokens > 20
    steps = -(-(m - 1) // 32)
    assert details(same) == (m - 1 - steps, 0)
    # As a list of text parts, split anywhere: the same.
    parts = [{"type": "text", "text": text[:7]}, {"type": "text", "text": text[7:]}]
    as_parts = chat(c, prediction={"type": "content", "content": parts})
    assert as_parts.choices[0].message.content == text and details(as_parts) == details(same)
    # The code before the edit (SmolLM2 rewrites more than the name): what it copies accepted.
    edit = chat(c, prediction={"type": "content", "content": CODE})
    assert edit.choices[0].message.content == text
    accepted, rejected = details(edit)
    assert accepted > 5 and rejected > 0
    # Other code sharing a few tokens: mostly rejected, the answer unchanged.
    other = chat(c, prediction={"type": "content", "content": "print(len(values))\n" * 10})
    assert other.choices[0].message.content == text
    accepted, rejected = details(other)
    assert rejected > accepted
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_seeded_sampling_and_streaming_equal(server):
    c, _ = server
    args = {"temperature": 0.9, "seed": 11, "max_tokens": 60}
    plain = chat(c, **args).choices[0].message.content
    prediction = {"type": "content", "content": CODE}
    assert chat(c, prediction=prediction, **args).choices[0].message.content == plain
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=ASK,
            stream=True,
            stream_options={"include_usage": True},
            prediction={"type": "content", "content": plain},
            **args,
        )
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == plain
    accepted, rejected = details(chunks[-1])
    assert rejected == 0 and accepted > 30


def test_completions_with_a_prediction(server):
    c, _ = server
    args = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 50, "temperature": 0}
    plain = c.completions.create(**args)
    text = plain.choices[0].text
    prediction = {"type": "content", "content": text[:20] + "x = 1\n" + text[20:]}
    got = c.completions.create(**args, extra_body={"prediction": prediction})
    assert got.choices[0].text == text
    accepted, rejected = details(got)
    assert accepted > 20 and rejected > 0


def test_with_a_forced_tool_call(server):
    """tool_choice "required": the grammar's forced tokens ride first, the prediction after."""
    c, _ = server
    args = {
        "messages": [{"role": "user", "content": "Weather in Nice for 2 days?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
    }
    plain = chat(c, **args).choices[0].message.tool_calls[0].function.arguments
    predicted = '{"city": "Nice", "unit": "celsius", "days": 2}'
    got = chat(c, prediction={"type": "content", "content": predicted}, **args)
    assert got.choices[0].message.tool_calls[0].function.arguments == plain


def test_with_an_adapter(smol, client):
    """The fp32 server's adapter (seeded sampling, where it shows): the base model's answer as
    the prediction."""
    args = {"temperature": 1.0, "seed": 3, "max_tokens": 60}
    base = chat(client, **args).choices[0].message.content
    lora = chat(client, model="demo-lora-a", **args).choices[0].message.content
    assert lora != base
    prediction = {"type": "content", "content": base}
    got = chat(client, model="demo-lora-a", prediction=prediction, **args)
    assert got.choices[0].message.content == lora


@pytest.mark.parametrize(
    "prediction, why",
    [
        ("some text", "prediction must be an object"),
        ({"type": "text", "content": "x"}, 'prediction must be {"type": "content"'),
        ({"type": "content", "content": 123}, 'prediction must be {"type": "content"'),
        ({"type": "content"}, 'prediction must be {"type": "content"'),
        ({"type": "content", "content": [{"type": "image_url"}]}, "a list of text parts"),
        ({"type": "content", "content": "x", "extra": 1}, 'prediction must be {"type"'),
        ({"type": "content", "content": "a " * (MAX_PREDICTION_TOKENS + 10)}, "at most 32768"),
    ],
)
def test_bad_predictions_are_400s_naming_the_parameter(gguf_client, prediction, why):
    c, _ = gguf_client
    for call in (
        lambda: chat(c, prediction=prediction),
        lambda: c.completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"prediction": prediction}
        ),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.status_code == 400
        assert info.value.body["param"] == "prediction" and why in info.value.body["message"]
