"""SamplingParams validation, and request rejection by the engine leaving nothing behind."""

from __future__ import annotations

import math

import pytest

import engine.step_results as step_results
from engine import LLM, SamplingParams
from engine.errors import ParamError
from models import VOCAB

MAX_MODEL_LEN = 64
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

INVALID = [
    ("n", dict(n=0)),
    ("n", dict(n=-3)),
    ("n", dict(n=1.5)),
    ("n", dict(n=True)),
    ("temperature", dict(temperature=-1)),
    ("temperature", dict(temperature=-1e-9)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=math.inf)),
    ("temperature", dict(temperature="1")),
    ("top_p", dict(top_p=0)),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p=-0.1)),
    ("top_p", dict(top_p=math.nan)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=1.5)),
    ("top_k", dict(top_k=True)),
    ("min_p", dict(min_p=2)),
    ("min_p", dict(min_p=-0.1)),
    ("min_p", dict(min_p=math.nan)),
    ("seed", dict(seed="a")),
    ("seed", dict(seed=1.5)),
    ("seed", dict(seed=True)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-1)),
    ("max_tokens", dict(max_tokens=2.0)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=5, max_tokens=4)),
    ("min_tokens", dict(min_tokens=1.5)),
    ("stop", dict(stop="")),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=["ok", ""])),
    ("stop", dict(stop=[1])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=["a"])),
    ("stop_token_ids", dict(stop_token_ids=[1.0])),
    ("repetition_penalty", dict(repetition_penalty=0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("repetition_penalty", dict(repetition_penalty=101)),
    ("repetition_penalty", dict(repetition_penalty=math.nan)),
    ("presence_penalty", dict(presence_penalty=3)),
    ("presence_penalty", dict(presence_penalty=-2.5)),
    ("presence_penalty", dict(presence_penalty=math.nan)),
    ("frequency_penalty", dict(frequency_penalty=2.01)),
    ("frequency_penalty", dict(frequency_penalty=-math.inf)),
    ("logit_bias", dict(logit_bias={"x": 1})),
    ("logit_bias", dict(logit_bias={1: 500})),
    ("logit_bias", dict(logit_bias={1: -100.5})),
    ("logit_bias", dict(logit_bias={1: math.nan})),
    ("logit_bias", dict(logit_bias={1: "1"})),
    ("logit_bias", dict(logit_bias={-1: 1})),
    ("logit_bias", dict(logit_bias={None: 1})),
    ("logit_bias", dict(logit_bias=[(1, 1.0)])),
    ("logprobs", dict(logprobs=21)),
    ("logprobs", dict(logprobs=-1)),
    ("logprobs", dict(logprobs=1.0)),
    ("prompt_logprobs", dict(prompt_logprobs=21)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
]


@pytest.mark.parametrize(
    "name, kwargs", INVALID, ids=[f"{n}={next(iter(k.values()))!r}" for n, k in INVALID]
)
def test_invalid_value_names_the_parameter(name, kwargs):
    """In its message and as ParamError.param (what the server answers as the error's param)."""
    with pytest.raises(ParamError, match=name) as err:
        SamplingParams(**kwargs)
    assert err.value.param == name


# Bad types that are not iterables of the right kind: the contract (ValueError naming the
# parameter) is broken because `list(...)` in __post_init__ runs before validation.
BAD_TYPES = [
    ("stop", dict(stop=5)),
    ("stop_token_ids", dict(stop_token_ids=7)),
]


@pytest.mark.parametrize("name, kwargs", BAD_TYPES, ids=[n for n, _ in BAD_TYPES])
def test_non_iterable_stop_names_the_parameter(name, kwargs):
    with pytest.raises(ParamError, match=name) as err:
        SamplingParams(**kwargs)
    assert err.value.param == name


def test_fractional_logit_bias_key_rejected():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1.7: 1.0})


VALID = [
    dict(temperature=0),
    dict(temperature=0, top_p=1, min_p=1),
    dict(top_p=1e-6, top_k=1, min_p=0),
    dict(top_k=-1),
    dict(max_tokens=None, min_tokens=100),
    dict(max_tokens=3, min_tokens=3),
    dict(repetition_penalty=100, presence_penalty=-2, frequency_penalty=2),
    dict(logit_bias={"5": 100, 6: -100}),
    dict(logprobs=0, prompt_logprobs=20),
    dict(seed=0, n=4),
    dict(stop="x", stop_token_ids=[0]),
]


@pytest.mark.parametrize("kwargs", VALID)
def test_valid_values_accepted(kwargs):
    SamplingParams(**kwargs)


def test_normalisation():
    p = SamplingParams(top_k=-1, stop="end", logit_bias={"5": 2})
    assert p.top_k == 0 and p.stop == ["end"] and p.stop_token_ids == []
    assert p.logit_bias == {5: 2.0}
    assert SamplingParams(temperature=1e-6).is_greedy and not SamplingParams().is_greedy


# ---- through the engine --------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), num_kv_blocks=32, max_model_len=MAX_MODEL_LEN)


def assert_clean_and_serving(llm: LLM) -> None:
    """Nothing left behind by a rejection, and the engine still serves."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.kv.pool.num_free == engine.kv.pool.num_usable
    (out,) = llm.generate([[65, 66, 67]], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free == engine.kv.pool.num_usable


@pytest.mark.parametrize(
    "name, params",
    [
        ("logit_bias", SamplingParams(logit_bias={VOCAB: 1.0})),
        ("logit_bias", SamplingParams(logit_bias={VOCAB + 1000: -1.0, 3: 1.0})),
        ("stop_token_ids", SamplingParams(stop_token_ids=[3, VOCAB])),
    ],
)
def test_out_of_vocab_ids_rejected(llm, name, params):
    with pytest.raises(ParamError, match=name) as err:
        llm.engine.add_request("bad-vocab", [1, 2, 3], params)
    assert str(VOCAB) in str(err.value) and err.value.param == name
    assert_clean_and_serving(llm)


def test_last_vocab_id_accepted(llm):
    params = SamplingParams(
        temperature=0, max_tokens=3, logit_bias={VOCAB - 1: 100.0}, stop_token_ids=[VOCAB - 1]
    )
    (out,) = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert out.outputs[0].token_ids == [VOCAB - 1] and out.outputs[0].stop_reason == VOCAB - 1
    assert_clean_and_serving(llm)


@pytest.mark.parametrize("length", [MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 3 * MAX_MODEL_LEN])
def test_prompt_over_context_limit_rejected(llm, length):
    with pytest.raises(ParamError, match="prompt") as err:
        llm.engine.add_request("too-long", [7] * length, GREEDY)
    assert str(length) in str(err.value) and str(MAX_MODEL_LEN) in str(err.value)
    assert err.value.param == "prompt"
    assert_clean_and_serving(llm)


def test_longest_prompt_accepted_and_capped(llm):
    (out,) = llm.generate([[7] * (MAX_MODEL_LEN - 1)], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert_clean_and_serving(llm)


@pytest.mark.parametrize("prompt", ["", []], ids=["text", "ids"])
def test_empty_prompt_rejected(llm, prompt):
    with pytest.raises(ValueError, match="prompt"):
        llm.engine.add_request("empty", prompt, GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert_clean_and_serving(llm)


@pytest.mark.parametrize("bad_id", [-1, VOCAB, 10**9])
def test_prompt_token_out_of_range_rejected(llm, bad_id):
    with pytest.raises(ParamError, match=str(bad_id)) as err:
        llm.engine.add_request("bad-token", [1, bad_id, 2], GREEDY)
    assert err.value.param == "prompt"
    assert_clean_and_serving(llm)


def test_request_larger_than_kv_pool_rejected(tiny_llama):
    llm = LLM(str(tiny_llama), num_kv_blocks=4, block_size=8, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(ParamError, match="KV blocks") as err:
        llm.engine.add_request("big", [1] * 20, SamplingParams(max_tokens=30))
    assert err.value.param == "max_tokens"
    with pytest.raises(ParamError, match="n=3") as err:
        llm.engine.add_request("wide", [1] * 4, SamplingParams(n=3, max_tokens=10))
    assert err.value.param == "max_tokens"  # what to lower first (the message says: or n)
    assert_clean_and_serving(llm)


def test_duplicate_request_id_rejected(llm):
    llm.engine.add_request("dup", [1, 2, 3], GREEDY)
    with pytest.raises(ParamError, match="dup") as err:
        llm.engine.add_request("dup", [4, 5, 6], GREEDY)
    assert err.value.param == "request_id"
    outs = []
    while llm.engine.has_unfinished_requests():
        outs.extend(o for o in llm.engine.step() if o.finished)
    assert [o.prompt_token_ids for o in outs] == [[1, 2, 3]]
    assert_clean_and_serving(llm)


@pytest.mark.parametrize("bad_index", [0, 2, 4])
def test_generate_with_one_bad_prompt_leaves_nothing(llm, bad_index):
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(5)]
    prompts[bad_index] = [1] * (MAX_MODEL_LEN + 5)
    with pytest.raises(ValueError, match=str(MAX_MODEL_LEN + 5)):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_clean_and_serving(llm)


def test_generate_with_one_bad_params_leaves_nothing(llm):
    params = [GREEDY, SamplingParams(n=2, max_tokens=4), SamplingParams(stop_token_ids=[VOCAB])]
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[1, 2], [3, 4], [5, 6]], params, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1, 2], [3, 4]], [GREEDY], use_tqdm=False)
    assert_clean_and_serving(llm)


def test_top_k_larger_than_vocab_served(llm):
    params = [GREEDY, SamplingParams(top_k=VOCAB + 1, max_tokens=4, ignore_eos=True)]
    outs = llm.generate([[1, 2, 3], [4, 5, 6]], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_engine_recovers_after_a_failed_step(llm, monkeypatch):
    """A step that raises (here: a sampler failure) aborts the whole generate call cleanly."""

    def failing_sample(*args, **kwargs):
        raise RuntimeError("injected sampler failure")

    monkeypatch.setattr(step_results, "HostCopy", failing_sample)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([[1, 2, 3], [4, 5, 6]], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_clean_and_serving(llm)
