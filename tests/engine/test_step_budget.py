"""The step-time budget (engine/step_budget.py): beside decoding requests a step takes only the
prompt tokens its fitted cost allows within max_step_ms (at least min_chunk); alone, a prompt
takes the whole token budget. (On the default path the chunks it makes leave every request's
tokens and logprob bits as they are: tests/e2e/test_gguf_invariance.py.)"""

from __future__ import annotations

import re

import pytest
from blocks import make_request

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import Scheduler
from engine.step_budget import StepBudget

BLOCK = 4


def fitted_budget(max_step_ms: float) -> StepBudget:
    """A budget whose cost fit saw steps of 2 ms + 0.5 ms per token."""
    budget = StepBudget(max_step_ms, min_chunk=BLOCK)
    for tokens in (8, 40, 100, 8, 40):
        budget.observe(tokens, 0.002 + 0.0005 * tokens)
    assert budget.cost.fixed == pytest.approx(0.002) and budget.cost.per_row == pytest.approx(5e-4)
    return budget


def run_step(sched: Scheduler) -> dict[str, int]:
    """Schedule one step and play the engine: tokens computed, one sampled per caught-up
    request. Returns each scheduled request's new tokens."""
    out = sched.schedule()
    for r, n, _ in out.scheduled():
        r.num_computed_tokens += n
        sched.kv.cache_blocks(r)
    for r in out.requests:
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(7)
    return {r.request_id: n for r, n, _ in out.scheduled()}


def decoding_and_a_long_prompt(budget: StepBudget | None) -> Scheduler:
    """Three requests decoding, then a 200-token prompt arrives."""
    sched = Scheduler(KVCacheManager(200, BLOCK, False), 8, 256, None, budget)
    for i in range(3):
        sched.add(make_request(f"d{i}", [1, 2, 3, 4, 5], BLOCK))
    assert run_step(sched) == {"d0": 5, "d1": 5, "d2": 5}
    sched.add(make_request("long", list(range(10, 210)), BLOCK))
    return sched


def test_prompt_chunks_shrink_beside_decodes_to_fit_the_step():
    sched = decoding_and_a_long_prompt(fitted_budget(20.2))
    # (20.2 - 2) ms / 0.5 ms = 36.4: 36 tokens a step, 3 decodes and 33 of the prompt (the
    # fit is exact here, so its residuals and margin are ~0).
    assert run_step(sched) == {"d0": 1, "d1": 1, "d2": 1, "long": 33}
    assert run_step(sched) == {"d0": 1, "d1": 1, "d2": 1, "long": 33}


def noisy_budget(max_step_ms: float, jitter_ms: float) -> StepBudget:
    """A budget whose steps cost 2 ms + 0.5 ms per token, give or take jitter (signs
    alternating, fixed: the same every run)."""
    budget = StepBudget(max_step_ms, min_chunk=BLOCK)
    for i in range(60):
        tokens = (8, 40, 100)[i % 3]
        noise = (jitter_ms if i % 2 else -jitter_ms) / 1000
        budget.observe(tokens, 0.002 + 0.0005 * tokens + noise)
    return budget


def test_steps_are_planned_below_the_budget_by_the_residuals_spread():
    # Steps 2 ms off the fit either way: the margin is about twice their spread plus the fit's
    # own error (~4.7 ms), so a 30.2 ms budget plans ~(30.2 - 4.7 - 2) / 0.5 - 3 = 43 prompt
    # tokens a step, not the mean fit's 53.
    budget = noisy_budget(30.2, jitter_ms=2.0)
    assert 0.004 <= budget.cost.margin <= 0.0055
    sched = decoding_and_a_long_prompt(budget)
    room = 0.0302 - budget.cost.margin - budget.cost.fixed
    want = int(room / budget.cost.per_row) - 3
    assert 40 <= want <= 45
    assert run_step(sched) == {"d0": 1, "d1": 1, "d2": 1, "long": want}
    # Without the jitter the same budget plans the mean fit's whole room: the margin is what
    # shrank the chunk above.
    exact = decoding_and_a_long_prompt(noisy_budget(30.2, jitter_ms=0.0))
    assert run_step(exact) == {"d0": 1, "d1": 1, "d2": 1, "long": 53}


def test_a_fit_that_underestimates_steps_plans_below_it():
    # Every step 3 ms over what the fit of the earlier ones predicted (a cost that moved): the
    # residuals' mean enters the margin, so at least 6 tokens (3 ms) fewer than the 53 before.
    budget = noisy_budget(30.2, jitter_ms=0.0)
    for _ in range(40):
        budget.observe(40, budget.cost(40) + 0.003)
    assert budget.cost.margin >= 0.003
    assert budget.prompt_tokens(3, 256) <= 53 - 6
    # A margin never takes more than half the budget: jitter of 20 ms gives ~48 ms, capped.
    starved = noisy_budget(30.2, jitter_ms=20.0)
    assert starved.cost.margin > 0.0302
    room = 0.0151 - starved.cost.fixed
    assert starved.prompt_tokens(3, 256) == int(room / starved.cost.per_row) - 3 > BLOCK


def test_without_a_budget_the_prompt_takes_the_token_budget():
    sched = decoding_and_a_long_prompt(None)
    assert run_step(sched) == {"d0": 1, "d1": 1, "d2": 1, "long": 200}


def test_alone_a_prompt_takes_the_whole_token_budget():
    sched = Scheduler(KVCacheManager(200, BLOCK, False), 8, 64, None, fitted_budget(20.0))
    sched.add(make_request("long", list(range(10, 210)), BLOCK))
    assert run_step(sched) == {"long": 64}


def test_a_tight_budget_still_moves_prompts_by_min_chunk():
    sched = decoding_and_a_long_prompt(fitted_budget(0.5))
    assert run_step(sched) == {"d0": 1, "d1": 1, "d2": 1, "long": BLOCK}


def test_a_tight_budget_gives_prompts_as_many_rows_as_the_decodes():
    """Six decodes, a budget below the step's fixed cost: six prompt tokens (not min_chunk's
    four), so prompts keep at least half of every step."""
    sched = Scheduler(KVCacheManager(200, BLOCK, False), 8, 256, None, fitted_budget(0.5))
    for i in range(6):
        sched.add(make_request(f"d{i}", [1, 2, 3], BLOCK))
    run_step(sched)
    sched.add(make_request("long", list(range(10, 210)), BLOCK))
    assert run_step(sched) == {**{f"d{i}": 1 for i in range(6)}, "long": 6}


def test_an_unfitted_budget_limits_nothing():
    sched = decoding_and_a_long_prompt(StepBudget(20.0, BLOCK))
    assert run_step(sched) == {"d0": 1, "d1": 1, "d2": 1, "long": 200}


@pytest.mark.parametrize("value", [0, -5, float("nan"), "10", True])
def test_max_step_ms_refuses_bad_values(value):
    with pytest.raises(
        ValueError, match=rf"^max_step_ms must be .*, got {re.escape(repr(value))}$"
    ):
        EngineConfig(max_step_ms=value)


@pytest.mark.parametrize(
    ("flags", "want"),
    [([], 100.0), (["--max-step-ms", "150"], 150.0), (["--max-step-ms", "0"], None)],
)
def test_the_server_budgets_steps_by_default(flags, want):
    """`tandem serve` bounds step time unless told not to; the Python API's default is off."""
    import argparse

    from playground.launch import add_server_args, engine_config

    parser = argparse.ArgumentParser()
    add_server_args(parser, 8000)
    assert engine_config(parser.parse_args(flags), {}).max_step_ms == want
    assert EngineConfig(model="m").max_step_ms is None
