"""Beam search over HTTP (vLLM's use_beam_search): the offline API's beams, as choices."""

from __future__ import annotations

import httpx
import pytest
from web import API_KEY, wait_idle

from engine.beam_search import BeamSearchParams

MODEL = "smollm2-135m-instruct"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def test_completions_and_chat_beams_equal_offline(client, offline, smol):
    prompts = ["The three primary colours are", "A good name for a cat is"]
    r = client.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=12,
        n=2,
        extra_body={"use_beam_search": True, "best_of": 3},
    )
    outs = offline.beam_search(prompts, BeamSearchParams(3, 12))
    want = [s for out in outs for s in out.sequences[:2]]
    assert [c.text for c in r.choices] == [s.text for s in want]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.finish_reason for c in r.choices] == [s.finish_reason for s in want]
    assert r.usage.completion_tokens == sum(len(s.token_ids) for s in want)
    chat = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=10, n=2, extra_body={"use_beam_search": True}
    )
    (out,) = offline.beam_search([offline.apply_chat_template(chat)], BeamSearchParams(2, 10))
    assert [c.message.content for c in r.choices] == [s.text for s in out.sequences]
    snap = wait_idle(smol[1].engine)
    assert (
        snap["num_free_blocks"] == snap["num_blocks"] and not smol[1].engine.engine.scheduler.held
    )


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"stream": True}, "stream"),
        ({"logprobs": 2}, "logprobs"),
        ({"temperature": 0.7}, "temperature"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"n": 11}, "beam_width"),
        ({"length_penalty": "long"}, "length_penalty"),
        ({"model": "demo-lora-a"}, "model"),
    ],
)
def test_beam_errors_name_the_field(smol, fields, param):
    url, state = smol
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "use_beam_search": True} | fields
    r = httpx.post(url + "/v1/completions", json=body, headers=HEADERS)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]
