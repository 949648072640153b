"""The default path (an embedded model's own GGUF blocks on the C++ kernels): a request gets the
same tokens and the same logprob bits whatever shares its step, whether its prompt is cached,
however it is chunked (by the token budget or the step-time budget), after preemption and
recompute, and beside adapter requests.

Each variant is compared with the requests run one at a time on an engine without prefix
caching (the whole prompt in one step). The broken variant puts prefill chunks back on the
Python layers' numerics (the bug this guards against: a prompt's rows took another path than
its decode rows, so a cache hit changed the answer) and the same comparison rejects it.
SmolLM2 runs in the default suite, with a float32 KV cache, an int8 one and a bfloat16 one
(their rows are rounded as they are stored, so they too depend on the request's tokens only); the
Qwen2.5-Coder models and Gemma 3 270M (its layers one C++ call each, sliding and full) are `slow`
and need their weight packages (the skip message prints the pip command).
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.models.registry import EMBEDDED_MODELS, ModelNotFoundError, resolve_model

SYSTEM = "You are a careful assistant. Answer in plain English, briefly and precisely."
QUESTIONS = [
    "Why is the sky blue?",
    "Write a haiku about a lighthouse.",
    "List three uses of a hash table.",
    "What does a compiler do?",
    "Why is the sky blue?",  # the same prompt twice: a cache hit on a whole prompt
]
NEW_TOKENS = 24


def sampling() -> list[SamplingParams]:
    """Greedy with and without logprobs (the argmax shortcut and the full pipeline), and
    seeded sampling under every logits processor."""
    common = dict(max_tokens=NEW_TOKENS, ignore_eos=True)
    return [
        SamplingParams(temperature=0, logprobs=1, **common),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, logprobs=1, **common),
        SamplingParams(
            temperature=1.0,
            top_k=20,
            min_p=0.05,
            presence_penalty=0.5,
            seed=12,
            logprobs=1,
            **common,
        ),  # fmt: skip
        SamplingParams(
            temperature=0.7,
            repetition_penalty=1.2,
            frequency_penalty=0.3,
            logit_bias={13: -2.0, 28: 1.5},
            seed=13,
            logprobs=1,
            **common,
        ),  # fmt: skip
        SamplingParams(temperature=0, **common),
    ]


def results(outputs) -> list[tuple[list[int], list[float] | None]]:
    """Each request's tokens and its chosen tokens' logprobs (floats compared exactly)."""
    got = []
    for out in outputs:
        c = out.outputs[0]
        steps = zip(c.token_ids, c.logprobs or [], strict=False)
        got.append((c.token_ids, [p[t].logprob for t, p in steps] if c.logprobs else None))
    return got


def prompts_for(llm: LLM) -> list[list[int]]:
    if not getattr(llm.tokenizer, "chat_template", None):  # (Gemma 3 270M: a base model)
        return [llm.tokenizer.encode(f"{SYSTEM}\n\n{q}") for q in QUESTIONS]
    chats = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS
    ]
    return [llm.apply_chat_template(c) for c in chats]


def run(llm: LLM, prompts, params, lora_request=None) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]  # nothing leaked
    return results(outs)


def alone(name: str, **kw) -> tuple[list, list, list]:
    """(prompts, params, each request's results run by itself without prefix caching); kw:
    more of the engines' config (the KV cache's dtype)."""
    llm = LLM(name, enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20, **kw)
    assert llm.engine.runner.model.fused_layers  # the C++ kernels: the default path
    prompts, params = prompts_for(llm), sampling()
    return prompts, params, [run(llm, [p], [q])[0] for p, q in zip(prompts, params, strict=True)]


def variants(name: str, prompts, params, **kw) -> dict[str, list]:
    """The same batch under each way of splitting the work."""
    got = {}
    cached = LLM(name, enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20, **kw)
    got["batched"] = run(cached, prompts, params)
    got["prefix cache hits"] = run(cached, prompts, params)
    assert cached.engine.snapshot()["prefix_cache"]["hit_tokens"] > 0
    for chunk in (5, 33):  # chunk boundaries below and above a fused step's old 16-row limit
        llm = LLM(name, max_num_batched_tokens=chunk, enable_prefix_caching=True, **kw)
        got[f"chunks of {chunk}"] = run(llm, prompts, params)
    # A tiny step-time budget: beside decodes, prompts advance by a block per step.
    budget = LLM(
        name, max_num_batched_tokens=40, max_step_ms=0.001, enable_prefix_caching=False, **kw
    )
    got["step budget"] = run(budget, prompts, params)
    assert budget.engine.scheduler.step_budget.cost.fitted  # it did size the chunks
    tight = LLM(name, num_kv_blocks=14, block_size=8, enable_prefix_caching=False, **kw)
    got["preempted"] = run(tight, prompts, params)
    assert tight.engine.snapshot()["num_preemptions"] > 0
    return got


@pytest.fixture(scope="module")
def smollm2():
    return alone("smollm2-135m-instruct")


def test_smollm2_gguf_requests_keep_their_bits(smollm2):
    prompts, params, want = smollm2
    for variant, got in variants("smollm2-135m-instruct", prompts, params).items():
        assert got == want, variant


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "bfloat16"])
def test_smollm2_gguf_requests_keep_their_bits_over_an_int8_or_bf16_cache(smollm2, kv_cache_dtype):
    name, kw = "smollm2-135m-instruct", {"kv_cache_dtype": kv_cache_dtype}
    prompts, params, want = alone(name, **kw)
    assert want != smollm2[2]  # (the cache is another numerics: some logprob bits differ)
    for variant, got in variants(name, prompts, params, **kw).items():
        assert got == want, variant


def test_smollm2_gguf_base_requests_keep_their_bits_beside_adapters(smollm2):
    """Adapter requests in the step: the layers compose the C++ pieces around the adapters'
    products; the base requests' numbers are the fused call's."""
    from playground.demo_adapters import write_demo_adapters

    prompts, params, want = smollm2
    adapters = list(write_demo_adapters("smollm2-135m-instruct").values())
    llm = LLM("smollm2-135m-instruct", enable_lora=True, enable_prefix_caching=False)
    interleaved, requests, base = [], [], []
    for i, p in enumerate(prompts):
        interleaved += [p, p]
        requests += [None, adapters[i % 2]]
        base.append(2 * i)
    got = run(llm, interleaved, [q for q in params for _ in (0, 1)], requests)
    assert [got[i] for i in base] == want
    assert all(got[i + 1][0] != got[i][0] for i in base[:2])  # the adapters do change tokens


def test_prefill_on_another_numerics_breaks_it(smollm2, monkeypatch):
    """The broken variant: in steps holding more than 16 rows (prefill chunks) the
    projections see their inputs rounded to bfloat16 (as the bf16 GEMM that once took
    prefill rows did); decode steps and cache hits' short queries run as before. The layers
    run as their pieces (the same bits as their one C++ call), so the projections are seen.
    The same comparison fails."""
    from engine.models.quantized import QuantizedLinear

    forward = QuantizedLinear.forward

    def bf16_rows(self, x):
        return forward(self, x.bfloat16().float() if x.shape[0] > 16 else x)

    monkeypatch.setattr(QuantizedLinear, "forward", bf16_rows)
    prompts, params, want = smollm2
    llm = LLM("smollm2-135m-instruct", enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20)
    for layer in llm.engine.runner.model.layers:
        layer.fused = None
    llm.engine.runner.model.stack = None
    assert run(llm, prompts, params) != want


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "gemma3-270m"]
)
def test_other_gguf_requests_keep_their_bits(name):
    try:
        resolve_model(name)
    except ModelNotFoundError:
        pytest.skip(f"{name} not installed: {EMBEDDED_MODELS[name].pip_command}")
    prompts, params, want = alone(name)
    for variant, got in variants(name, prompts, params).items():
        assert got == want, variant
