"""Output kinds (CUMULATIVE, DELTA, FINAL_ONLY) and what building outputs costs per step."""

from __future__ import annotations

import pytest

import engine.outputs as outputs
from engine import LLM, RequestOutputKind, SamplingParams
from engine.llm_engine import LLMEngine

PROMPT = "Hello, world!"
KINDS = list(RequestOutputKind)


@pytest.fixture(scope="module")
def llm(tiny_llama, draft_model):
    # A draft model that mostly misses: drafts every step, most rejected (rejected_drafts).
    return LLM(
        str(tiny_llama),
        num_kv_blocks=96,
        max_model_len=256,
        draft_model=str(draft_model),
        adaptive_speculation=False,
        num_speculative_tokens=3,
    )


def params(kind: RequestOutputKind, **kw) -> SamplingParams:
    base = dict(
        temperature=0.8,
        seed=7,
        n=2,
        max_tokens=30,
        logprobs=2,
        prompt_logprobs=1,
        stop=["zz"],
        output_kind=kind,
    )
    return SamplingParams(**{**base, **kw})


def run(engine: LLMEngine, requests: dict[str, SamplingParams]) -> dict[str, list]:
    """Every output of each request, step after step, the requests side by side."""
    for rid, p in requests.items():
        engine.add_request(rid, PROMPT, p)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    assert engine.kv.pool.num_free == engine.kv.pool.num_usable
    return outs


def joined(deltas: list) -> dict[int, dict]:
    """Each completion put together from its deltas."""
    whole: dict[int, dict] = {}
    for out in deltas:
        for c in out.outputs:
            w = whole.setdefault(
                c.index,
                dict(text="", token_ids=[], kinds="", logprobs=[], rejected=[], finishes=[]),
            )
            assert c.text or c.token_ids or c.finish_reason, "a completion with nothing new"
            w["text"] += c.text
            w["token_ids"] += c.token_ids
            w["kinds"] += c.token_kinds
            w["logprobs"] += c.logprobs or []
            w["rejected"] += c.rejected_drafts
            if c.finish_reason is not None:
                w["finishes"].append(c.finish_reason)
    return whole


def test_output_kinds_carry_the_same_completions(llm):
    outs = run(llm.engine, {kind.name: params(kind) for kind in KINDS})
    cumulative, delta, final = (outs[k.name] for k in KINDS)
    last = cumulative[-1]
    assert last.finished and not any(o.finished for o in cumulative[:-1])
    assert sum(len(c.rejected_drafts) for c in last.outputs) > 0  # speculation was exercised
    # FINAL_ONLY: one output, the finished one, equal to CUMULATIVE's last.
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs == last.outputs
    assert final[0].prompt_logprobs == last.prompt_logprobs is not None
    # DELTA: as many outputs as CUMULATIVE; put together, its completions are the same.
    assert len(delta) == len(cumulative)
    assert delta[0].prompt_logprobs == last.prompt_logprobs
    assert all(o.prompt_logprobs is None for o in delta[1:])
    whole = joined(delta)
    assert sorted(whole) == [0, 1]
    for c in last.outputs:
        w = whole[c.index]
        assert w["text"] == c.text and w["token_ids"] == c.token_ids
        assert w["kinds"] == c.token_kinds and w["logprobs"] == c.logprobs
        assert w["rejected"] == c.rejected_drafts
        assert w["finishes"] == [c.finish_reason]  # once, with the last delta of it


@pytest.mark.parametrize("take_every", [1, 3, 1000])
def test_accumulated_deltas_equal_the_cumulative_output(llm, take_every):
    """engine.outputs.OutputAccumulator (the server's streams): deltas joined in pieces of
    take_every (a reader that takes after every output, one that falls behind, one that reads
    at the end) give, joined again, CUMULATIVE's last output: completions, prompt logprobs,
    finish."""
    from engine.outputs import OutputAccumulator

    kinds = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA)
    outs = run(llm.engine, {k.name: params(k) for k in kinds})
    last, deltas = outs["CUMULATIVE"][-1], outs["DELTA"]
    unread, whole = OutputAccumulator(), OutputAccumulator()
    for i, delta in enumerate(deltas, 1):
        unread.add(delta)
        if i % take_every == 0 or i == len(deltas):
            whole.add(unread.take())
    assert unread.empty
    got = whole.take()
    assert got.outputs == last.outputs and got.finished
    assert got.prompt_logprobs == last.prompt_logprobs is not None
    assert sum(len(c.rejected_drafts) for c in got.outputs) > 0


def test_delta_leaves_out_completions_with_nothing_new(llm):
    """n = 2, one completion ended early by a stop token the other never emits: after it ends,
    DELTA outputs carry the other alone, CUMULATIVE ones keep both."""
    kw = dict(logprobs=None, prompt_logprobs=None, stop=None, max_tokens=16, ignore_eos=True)
    (probe,) = run(llm.engine, {"probe": params(RequestOutputKind.FINAL_ONLY, **kw)})["probe"]
    first, second = (c.token_ids for c in probe.outputs)
    stop_at = next(i for i in range(1, 8) if first[i] not in second and first[i] not in first[:i])
    kw["stop_token_ids"] = [first[stop_at]]
    outs = run(
        llm.engine,
        {k.name: params(k, **kw) for k in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA)},
    )
    cumulative, delta = outs["CUMULATIVE"], outs["DELTA"]
    assert [len(o.outputs) for o in cumulative] == [2] * len(cumulative)
    # The output in which the first completion stopped, then the second's alone.
    ended = 1 + next(i for i, o in enumerate(delta) if o.outputs[0].finish_reason is not None)
    assert 1 < ended < len(delta)
    assert [len(o.outputs) for o in delta] == [2] * ended + [1] * (len(delta) - ended)
    assert all(o.outputs[0].index == 1 for o in delta[ended:])
    whole = joined(delta)
    assert [whole[i]["token_ids"] for i in (0, 1)] == [c.token_ids for c in cumulative[-1].outputs]
    assert whole[0]["token_ids"] == first[: stop_at + 1] and whole[1]["token_ids"] == second


def test_logprobs_are_decoded_once_per_position(llm, monkeypatch):
    """Cumulative outputs repeat every position's logprobs at every step; each is decoded to
    text once, when it is produced (decoding them all again per output was quadratic)."""
    engine = llm.engine
    calls = []
    real = outputs.decode_logprobs

    def counted(decode, raw):
        calls.extend(raw)
        return real(decode, raw)

    monkeypatch.setattr(outputs, "decode_logprobs", counted)
    p = params(RequestOutputKind.CUMULATIVE, n=1, stop=None, max_tokens=24, ignore_eos=True)
    outs = run(engine, {"c": p})["c"]
    assert len(outs) > 5
    last = outs[-1]
    positions = [lp for lp in last.prompt_logprobs if lp is not None] + last.outputs[0].logprobs
    assert len(calls) == sum(len(lp) for lp in positions)
    # Outputs already handed out are not changed by later steps.
    assert len(outs[0].outputs[0].logprobs) == len(outs[0].outputs[0].token_ids)


def test_llm_generate_and_stream_leave_the_callers_params_alone(llm):
    p = params(RequestOutputKind.CUMULATIVE, n=1, stop=None, max_tokens=10, ignore_eos=True)
    (out,) = llm.generate([PROMPT], p, use_tqdm=False)
    chunks = list(llm.stream(PROMPT, p))
    assert p.output_kind == RequestOutputKind.CUMULATIVE
    assert "".join(c.outputs[0].text for c in chunks) == out.outputs[0].text
    assert sum((c.outputs[0].token_ids for c in chunks), []) == out.outputs[0].token_ids
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])


@pytest.mark.parametrize("value", ["partial", 1, None])
def test_output_kind_is_checked(value):
    with pytest.raises(ValueError, match="output_kind must be one of cumulative, delta"):
        SamplingParams(output_kind=value)
    assert SamplingParams(output_kind="final_only").output_kind == RequestOutputKind.FINAL_ONLY
