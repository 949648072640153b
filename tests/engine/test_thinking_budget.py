"""engine/grammar/thinking.py through the engine, on a tiny random Qwen3 with Qwen3's chat
template: `thinking_token_budget = N` puts `</think>` at exactly the N-th token after `<think>`
(left open by the prompt, or the output's first token), riding as a forced draft ('f'); the
tokens before the cut are the model's own, a budget the thinking never reaches changes nothing
(greedy and seeded, with and without n-gram speculation), a budget composes with a constraint,
and a bad budget is a ValueError naming it."""

from __future__ import annotations

import re

import pytest

from engine import LLM, SamplingParams
from engine.entrypoints.llm import chat_prompt_ids

OPEN, CLOSE, TOOL_CALL = 259, 260, 261
MAX_TOKENS = 24
BIAS = 3.0  # on `</think>`: this model then closes its thinking after 4-5 tokens


@pytest.fixture(scope="module")
def llm(thinking_qwen3):
    return LLM(str(thinking_qwen3), num_kv_blocks=128, num_threads=1)


@pytest.fixture(scope="module")
def ngram_llm(thinking_qwen3):
    return LLM(str(thinking_qwen3), num_kv_blocks=128, num_threads=1, speculative_method="ngram")


def prompt(llm, enable_thinking: bool = True) -> list[int]:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    kwargs = {"enable_thinking": enable_thinking}
    return chat_prompt_ids(llm.engine.tokenizer, messages, template_kwargs=kwargs)


def run(llm, prompt_ids: list[int], **params):
    args = dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True) | params
    (out,) = llm.generate([prompt_ids], SamplingParams(**args), use_tqdm=False)
    return out.outputs[0]


def test_the_template_leaves_thinking_to_the_model(llm):
    """Qwen3's template opens no `<think>` itself; with enable_thinking false it closes one."""
    text = llm.engine.tokenizer.decode(prompt(llm, False), skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt(llm)[-1] != OPEN and CLOSE not in prompt(llm)


@pytest.mark.parametrize("budget", [0, 1, 5, 17])
def test_budget_forces_the_closing_tag_at_exactly_token_n(llm, budget):
    """The prompt opens the thinking (a template that writes `<think>`, as DeepSeek-R1's): the
    first N tokens are the model's own, token N is `</think>` (a forced draft), the rest the
    model's own continuation."""
    ids = prompt(llm) + [OPEN]
    free = run(llm, ids)
    assert CLOSE not in free.token_ids  # this model never closes on its own
    cut = run(llm, ids, thinking_token_budget=budget)
    assert cut.token_ids[:budget] == free.token_ids[:budget]
    assert cut.token_ids[budget] == CLOSE
    # A forced draft once the request decodes (budget 0: the prefill's token, masked).
    assert cut.token_kinds[budget] == ("p" if budget == 0 else "f")
    assert cut.token_ids.count(CLOSE) == 1 and len(cut.token_ids) == MAX_TOKENS
    rest = run(llm, ids + cut.token_ids[: budget + 1], max_tokens=MAX_TOKENS - budget - 1)
    assert cut.token_ids[budget + 1 :] == rest.token_ids


def test_budget_counts_from_the_outputs_own_opening_tag(llm):
    """A prompt that leaves the tag to the model: the budget starts after the output's first
    token when that is `<think>` (a logit bias makes this model write it, again and again)."""
    ids, bias = prompt(llm), {OPEN: 100}
    free = run(llm, ids, logit_bias=bias)
    assert free.token_ids == [OPEN] * MAX_TOKENS
    cut = run(llm, ids, logit_bias=bias, thinking_token_budget=3)
    assert cut.token_ids == [OPEN] * 4 + [CLOSE] + [OPEN] * (MAX_TOKENS - 5)
    # Without the tag at its start an output is no thinking: the budget never cuts it.
    assert run(llm, ids, thinking_token_budget=0).token_ids == run(llm, ids).token_ids


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_budget_the_thinking_never_reaches_changes_nothing(llm, ngram_llm, seeded):
    """The model closes its thinking itself (a logit bias on `</think>` that lets a few tokens
    come first): a budget past that point gives the same tokens as no budget, on an engine with
    or without n-gram speculation; a budget before it cuts there."""
    ids = prompt(llm) + [OPEN]
    sampling = {"temperature": 0.8, "seed": 7} if seeded else {}
    bias = {CLOSE: BIAS}
    free = run(llm, ids, logit_bias=bias, **sampling)
    at = free.token_ids.index(CLOSE)
    assert 2 <= at < MAX_TOKENS - 4, free.token_ids
    for engine in (llm, ngram_llm):
        for budget in (at, at + 1, 1000):
            out = run(engine, ids, logit_bias=bias, thinking_token_budget=budget, **sampling)
            assert out.token_ids == free.token_ids, (budget, engine is llm)
    cut = run(llm, ids, logit_bias=bias, thinking_token_budget=at - 1, **sampling)
    assert cut.token_ids[: at - 1] == free.token_ids[: at - 1] and cut.token_ids[at - 1] == CLOSE


def test_budget_with_speculation_is_exact(llm, ngram_llm):
    ids = prompt(llm) + [OPEN]
    plain = run(llm, ids, thinking_token_budget=9)
    assert run(ngram_llm, ids, thinking_token_budget=9).token_ids == plain.token_ids


def test_budget_composes_with_a_constraint(llm):
    """A regex constraint and a budget: the thinking is cut at N (the constraint allows the
    tag there, and the model, constrained alone, closes it one token later), and the whole
    answer still follows the constraint."""
    ids = prompt(llm) + [OPEN]
    regex = "[a-z]{1,6}</think>[0-9]{1,4}"
    free = run(llm, ids, structured_outputs={"regex": regex}, ignore_eos=False)
    assert free.token_ids.index(CLOSE) == 2
    params = dict(thinking_token_budget=1, structured_outputs={"regex": regex}, ignore_eos=False)
    out = run(llm, ids, **params)
    assert out.token_ids[:2] == [free.token_ids[0], CLOSE] and out.token_kinds[1] == "f"
    text = llm.engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert re.fullmatch(regex, text), text


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_budget_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=bad)
