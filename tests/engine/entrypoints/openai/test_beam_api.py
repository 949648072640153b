"""Beam search over HTTP (vLLM's use_beam_search): the offline API's beams, as choices."""

from __future__ import annotations

from web import wait_idle

from engine.entrypoints.beam_search import BeamSearchParams

MODEL = "smollm2-135m-instruct"


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
