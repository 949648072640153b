"""Lookahead decoding on the default path (EngineConfig.num_scheduler_steps): greedy requests
whose outputs nobody sees before they finish run several steps per scheduling round, embedding
to argmax in one C++ call (LayerStack.decode). Every request gets the tokens of one step at a
time, whatever ends it (EOS, a stop string, a stop token, max_tokens between rounds), alone or
batched, and every block returns to the pool; streamed and sampled requests are never run so.
A broken variant (the later steps of a call storing their KV in the first step's slots)
fails the same comparison."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import RequestOutputKind

MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "Write a story about a dog.",
    "List the planets of the solar system.",
    "What is 17 times 23?",
    "Name three colours.",
]


def greedy() -> list[SamplingParams]:
    """Each ends its own way: max_tokens not a multiple of the steps, a stop string, EOS (the
    chat model stops on its own after 40 tokens), a stop token (',' after 10)."""
    return [
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=200, stop=["Neptune"]),
        SamplingParams(temperature=0, max_tokens=100),
        SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[28]),
    ]


def generate(llm: LLM, prompts, params) -> list[tuple[list[int], str, str]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]  # nothing leaked
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


@pytest.fixture(scope="module")
def one_step():
    llm = LLM(MODEL, num_scheduler_steps=1, enable_prefix_caching=False)
    assert llm.engine.runner.model.stack.decodes  # the default path decodes in one call
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    want = [generate(llm, [p], [q])[0] for p, q in zip(prompts, greedy(), strict=True)]
    assert [(len(w[0]), w[2]) for w in want] == [(37, "length"), (36, "stop"), (40, "stop"),
                                                  (11, "stop")]  # fmt: skip
    assert llm.engine.num_steps >= 37 + 36 + 40 + 11  # a step per token
    return prompts, want, llm.engine.num_steps


@pytest.mark.parametrize("steps", [4, 7])
def test_lookahead_gives_the_tokens_of_one_step_at_a_time(one_step, steps):
    prompts, want, one_step_count = one_step
    llm = LLM(MODEL, num_scheduler_steps=steps, enable_prefix_caching=False)
    alone = [generate(llm, [p], [q])[0] for p, q in zip(prompts, greedy(), strict=True)]
    assert alone == want
    num_steps = llm.engine.num_steps
    assert num_steps < one_step_count * 0.6  # (several tokens a round did run)
    assert generate(llm, prompts, greedy()) == want  # batched, ending at different rounds


def test_streamed_and_sampled_requests_take_one_step_at_a_time(one_step):
    prompts, want, _ = one_step
    llm = LLM(MODEL, enable_prefix_caching=False)
    streamed = [q.with_output_kind(RequestOutputKind.DELTA) for q in greedy()]
    before = llm.engine.num_steps
    for prompt, params, expected in zip(prompts, streamed, want, strict=True):
        tokens = [t for out in llm.stream(prompt, params) for t in out.outputs[0].token_ids]
        assert tokens == expected[0]
    assert llm.engine.num_steps - before >= sum(len(w[0]) for w in want)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    before = llm.engine.num_steps
    llm.generate(prompts[0], sampled, use_tqdm=False)
    assert llm.engine.num_steps - before == 20


def test_lookahead_steps_writing_the_first_steps_slots_break_it(one_step, monkeypatch):
    """The broken variant: every step of a call stores its keys and values in the first
    step's slots (the later positions' cache entries never written)."""
    from engine.models.layer_stack import LayerStack

    decode = LayerStack.decode

    def first_slots(self, ids, positions, kv_caches, slots, tables):
        steps = len(slots) // len(ids)  # row b's step s at b steps + s
        slots = [slots[i - i % steps] for i in range(len(slots))]
        return decode(self, ids, positions, kv_caches, slots, tables)

    monkeypatch.setattr(LayerStack, "decode", first_slots)
    prompts, want, _ = one_step
    llm = LLM(MODEL, enable_prefix_caching=False)
    assert generate(llm, prompts, greedy()) != want


def test_nan_logits_in_a_decode_call_end_the_request(one_step):
    """A decode call whose logits are NaN (the final norm's weight poisoned after the prompt's
    step) ends its request with finish_reason "error", every block back in the pool; the
    engine then serves the same request as before. Without the check the request would
    finish "length" with NaN's argmax as tokens."""
    prompts, want, _ = one_step
    llm = LLM(MODEL, enable_prefix_caching=False)
    engine, norm = llm.engine, llm.engine.runner.model.norm.weight
    params = greedy()[0].with_output_kind(RequestOutputKind.FINAL_ONLY)
    engine.add_request("victim", prompts[0], params)
    engine.step()  # the prompt's step (its first token: the Python path)
    saved = norm.clone()
    norm.fill_(float("nan"))
    finals = []
    while engine.has_unfinished_requests():
        finals += [out for out in engine.step() if out.finished]
    norm.copy_(saved)
    assert [out.outputs[0].finish_reason for out in finals] == ["error"]
    snap = engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]
    assert generate(llm, [prompts[0]], [greedy()[0]]) == [want[0]]
