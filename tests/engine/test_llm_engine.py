"""LLMEngine's step, one owner at a time: the speculation's plan feeds the scheduler, its
proposals land on the step's SchedulerOutput, and the engine ends idle."""

from __future__ import annotations

from engine import LLM, SamplingParams
from spec.proposer import NgramProposer

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # a repeated phrase: n-gram lookup finds drafts


def test_plan_schedule_and_propose_fill_one_step(tiny_llama):
    llm = LLM(
        str(tiny_llama),
        num_kv_blocks=64,
        speculative_method="ngram",
        num_speculative_tokens=3,
        adaptive_speculation=False,
    )
    engine = llm.engine
    # The first token is 8 (biased), so the prompt's "7 8" recurs and the lookup proposes.
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={8: 100})
    engine.add_request("r", PROMPT, params)
    engine.step()  # the prefill, and the first token
    (request,) = engine.scheduler.running
    wanted = engine.speculation.plan(engine.scheduler.running)
    assert wanted == {request: 3}
    sched = engine.scheduler.schedule(wanted)
    assert sched.num_drafts == [3] and sched.num_new_tokens == [4]
    engine.speculation.propose(sched, engine.kv.block_tables, None)
    want = NgramProposer(engine.config.ngram_min, engine.config.ngram_max).lookup(
        request.token_ids, 3
    )
    assert want and sched.drafts[request] == want and sched.num_forced[request] == 0
    assert sched.num_drafts == [len(want)] and sched.num_new_tokens == [1 + len(want)]
    engine.scheduler.unschedule(sched)  # hand the step back: the engine runs on from here
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    (alone,) = LLM(str(tiny_llama), num_kv_blocks=64).generate([PROMPT], params, use_tqdm=False)
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert engine.kv.pool.num_free == engine.kv.pool.num_usable
