"""A request's tokens do not depend on its batch, chunk size, prefix caching or preemption."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

NUM_REQUESTS = 16


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 256, (20,), generator=g).tolist()
    prompts, params = [], []
    for i in range(NUM_REQUESTS):
        n = int(torch.randint(1, 40, (1,), generator=g))
        tail = torch.randint(0, 256, (n,), generator=g).tolist()
        prompts.append(shared + tail if i % 3 == 0 else tail)  # some share a prefix
        if i % 2:
            p = SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=12)
        else:
            p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        params.append(p)
    return prompts, params


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Each request run alone on a fresh engine with default settings."""
    prompts, params = workload()
    outs = []
    for prompt, p in zip(prompts, params, strict=True):
        llm = LLM(str(tiny_llama), num_kv_blocks=64)
        outs.append(llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids)
    return outs


def run_batch(model_dir, **engine_args):
    llm = LLM(str(model_dir), **engine_args)
    prompts, params = workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]
    return [o.outputs[0].token_ids for o in outs], snap


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_batch_chunk_and_caching(tiny_llama, reference, chunk, prefix_caching):
    tokens, snap = run_batch(
        tiny_llama,
        num_kv_blocks=128,
        max_num_batched_tokens=chunk,
        enable_prefix_caching=prefix_caching,
    )
    assert tokens == reference
    if prefix_caching and chunk == 64:
        assert snap["prefix_cache"]["hit_tokens"] > 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forced_preemption(tiny_llama, reference, prefix_caching):
    tokens, snap = run_batch(
        tiny_llama, num_kv_blocks=12, block_size=8, enable_prefix_caching=prefix_caching
    )
    assert snap["num_preemptions"] > 0
    assert tokens == reference
