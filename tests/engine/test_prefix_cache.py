"""Prefix caching through the real engine on a tiny random model: exact hit counts, identical
outputs with and without hits, cache_salt isolation, LRU eviction, process-stable hashes."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys

import pytest

import engine.block_pool
from engine import LLM, SamplingParams
from engine.request import Request

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
_request_ids = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tiny_llama):
    return str(tiny_llama)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def run(llm: LLM, prompt: list[int], params=GREEDY, cache_salt: str | None = None):
    """One request through the engine; returns its final RequestOutput and the hit delta."""
    eng = llm.engine
    before = eng.snapshot()["prefix_cache"]
    eng.add_request(f"req-{next(_request_ids)}", prompt, params, cache_salt=cache_salt)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final = out
    after = eng.snapshot()["prefix_cache"]
    assert after["query_tokens"] - before["query_tokens"] == len(prompt)
    return final, after["hit_tokens"] - before["hit_tokens"]


def ids(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def assert_idle(llm: LLM) -> None:
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"] and snap["num_used_blocks"] == 0
    assert snap["requests"] == [] and snap["num_running"] == snap["num_waiting"] == 0
    assert all(b["ref_count"] == 0 for b in snap["blocks"].values())
    pool = llm.engine.kv.pool
    assert pool.num_free == pool.num_usable and not any(pool.ref_counts)


def cached_blocks(llm: LLM, prompt: list[int], salt: str | None = None) -> list[bool]:
    """For each full block of the prompt: is its chained hash in the prefix cache?"""
    keys = engine.block_pool.cache_extra_keys(salt)
    req = Request("probe", prompt, SamplingParams(), set(), 10_000, 0, keys, BS)
    return [llm.engine.kv.pool.lookup(h) is not None for h in req.full_block_hashes()]


@pytest.mark.parametrize(
    ("prompt_len", "num_hit"),
    [(3 * BS + 5, 3 * BS), (2 * BS, BS), (BS + 1, BS), (BS, 0), (5, 0)],
)
def test_exact_hit_counts(model_dir, prompt_len, num_hit):
    llm = LLM(model_dir, num_kv_blocks=32, block_size=BS)
    prompt = tokens(prompt_len, seed=prompt_len)
    first, hit = run(llm, prompt)
    assert hit == 0 and first.num_cached_tokens == 0
    # The last prompt token is always recomputed (its logits are needed): an exact multiple of
    # the block size gives one block fewer.
    second, hit = run(llm, prompt)
    assert hit == num_hit and second.num_cached_tokens == num_hit
    assert second.metrics.num_cached_tokens == num_hit
    assert ids(second) == ids(first)
    snap = llm.engine.snapshot()["prefix_cache"]
    assert snap["hit_tokens"] == num_hit and snap["query_tokens"] == 2 * prompt_len
    assert_idle(llm)


def test_hits_follow_the_chain_not_the_block_content(model_dir):
    llm = LLM(model_dir, num_kv_blocks=32, block_size=BS)
    prompt = tokens(3 * BS + 5, seed=1)
    run(llm, prompt)
    _, hit = run(llm, prompt[: 2 * BS + 8] + tokens(20, seed=2))
    assert hit == 2 * BS  # shares two full blocks, then diverges
    # Block 1's tokens at position 0 (and again at 1): same content, different parent hash.
    _, hit = run(llm, prompt[BS : 2 * BS] * 2 + [1])
    assert hit == 0
    assert_idle(llm)


@pytest.mark.parametrize("max_num_batched_tokens", [1024, 7])
def test_outputs_identical_with_and_without_hits(model_dir, max_num_batched_tokens):
    base = tokens(2 * BS + 3, seed=3)
    prompts = [base + tokens(n, seed=10 + n) for n in (0, 1, 9, 30)] + [base[:20]]
    args = dict(num_kv_blocks=48, block_size=BS, max_num_batched_tokens=max_num_batched_tokens)
    plain = LLM(model_dir, enable_prefix_caching=False, **args)
    expected = [ids(o) for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(model_dir, **args)
    cold = llm.generate(prompts, GREEDY, use_tqdm=False)
    warm = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [ids(o) for o in cold] == [ids(o) for o in warm] == expected
    assert all(o.num_cached_tokens > 0 for o in warm)
    # n > 1 shares the prompt's blocks across siblings (copy-on-write at the first append).
    params = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
    twins = llm.generate(prompts, params, use_tqdm=False)
    assert [ids(o) for o in twins] == [e * 2 for e in expected]
    assert_idle(plain)
    assert_idle(llm)


def finish_all(llm: LLM) -> dict[str, list[int]]:
    """Step until idle; each request's token ids by request id."""
    done = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def shared_prefix_prompts() -> list[list[int]]:
    base = tokens(2 * BS, seed=5)
    return [base + tokens(3, seed=20 + i) for i in range(4)]


def expected_alone(model_dir, prompts) -> list[list[int]]:
    plain = LLM(model_dir, enable_prefix_caching=False, num_kv_blocks=48, block_size=BS)
    return [ids(o)[0] for o in plain.generate(prompts, GREEDY, use_tqdm=False)]


def test_requests_admitted_together_share_what_the_first_computes(model_dir):
    """Four prompts with two blocks in common, added at once: the first computes them and the
    other three, admitted in the same step, hit them (registered when allocated; each layer
    stores the batch's K/V before attending)."""
    prompts = shared_prefix_prompts()
    llm = LLM(model_dir, num_kv_blocks=48, block_size=BS)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"together-{i}", prompt, GREEDY)
    llm.engine.step()
    assert llm.engine.snapshot()["prefix_cache"]["hit_tokens"] == 3 * 2 * BS
    done = finish_all(llm)
    assert [done[f"together-{i}"] for i in range(4)] == expected_alone(model_dir, prompts)
    assert_idle(llm)


@pytest.mark.parametrize("where", ["launch", "wait"])
def test_a_failed_step_leaves_no_uncomputed_block_in_the_cache(model_dir, monkeypatch, where):
    """A step that raises as it is launched, or whose results never land (its K/V may never
    have been written): the blocks registered ahead of it leave the prefix cache and its
    requests queue again holding nothing, so the next steps compute everything and the
    outputs are as if it never happened."""
    from engine.model_runner import LaunchedStep, ModelRunner

    prompts = shared_prefix_prompts()
    llm = LLM(model_dir, num_kv_blocks=48, block_size=BS)
    owner = ModelRunner if where == "launch" else LaunchedStep
    real = getattr(owner, where)
    failures = iter([RuntimeError("injected")])

    def once_failing(*args):
        for exc in failures:
            raise exc
        return real(*args)

    monkeypatch.setattr(owner, where, once_failing)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"retry-{i}", prompt, GREEDY)
    with pytest.raises(RuntimeError, match="injected"):
        llm.engine.step()
    assert not any(cached_blocks(llm, prompts[0]))
    snap = llm.engine.snapshot()
    assert snap["num_used_blocks"] == 0 and snap["num_waiting"] == 4
    done = finish_all(llm)
    assert [done[f"retry-{i}"] for i in range(4)] == expected_alone(model_dir, prompts)
    assert_idle(llm)


def test_cache_salt_isolates(model_dir):
    llm = LLM(model_dir, num_kv_blocks=32, block_size=BS)
    prompt = tokens(3 * BS + 5, seed=4)
    plain, _ = run(llm, prompt)
    out, hit = run(llm, prompt, cache_salt="alice")
    assert hit == 0 and out.num_cached_tokens == 0 and ids(out) == ids(plain)
    out, hit = run(llm, prompt, cache_salt="bob")
    assert hit == 0 and out.num_cached_tokens == 0
    out, hit = run(llm, prompt, cache_salt="alice")
    assert hit == 3 * BS and out.num_cached_tokens == 3 * BS and ids(out) == ids(plain)
    out, hit = run(llm, prompt)
    assert hit == 3 * BS
    assert cached_blocks(llm, prompt, "alice") == cached_blocks(llm, prompt) == [True] * 3
    assert cached_blocks(llm, prompt, "carol") == [False] * 3
    assert_idle(llm)


@pytest.mark.parametrize("reuse_a", [False, True])
def test_lru_evicts_least_recently_freed_prefix(model_dir, reuse_a):
    # 6 usable blocks: each 33-token prompt holds 3 (2 full, cached) while it runs.
    llm = LLM(model_dir, num_kv_blocks=7, block_size=BS)
    a, b = (tokens(2 * BS + 1, seed=s) for s in (5, 6))
    c = tokens(3 * BS + 1, seed=7)
    run(llm, a, ONE_TOKEN)
    run(llm, b, ONE_TOKEN)
    if reuse_a:  # a hit makes A the most recently freed prefix
        _, hit = run(llm, a, ONE_TOKEN)
        assert hit == 2 * BS
    assert cached_blocks(llm, a) == cached_blocks(llm, b) == [True, True]
    # C needs 4 blocks: the 2 that hold nothing cached go first (a freed partial block and
    # one never used), then eviction takes the older prefix, all of it
    run(llm, c, ONE_TOKEN)
    older, newer = (b, a) if reuse_a else (a, b)
    assert cached_blocks(llm, older) == [False, False]
    assert cached_blocks(llm, newer) == [True, True]
    assert llm.engine.snapshot()["prefix_cache"]["evictions"] == 2
    _, hit = run(llm, newer, ONE_TOKEN)
    assert hit == 2 * BS
    _, hit = run(llm, older, ONE_TOKEN)
    assert hit == 0
    assert_idle(llm)


def test_eviction_takes_a_prefix_tail_first(model_dir):
    # 8 usable blocks. A holds 3; then 7 are needed at once: A's partial block and its second
    # full block go, its first full block stays (a request's tail is evicted before its head).
    llm = LLM(model_dir, num_kv_blocks=9, block_size=BS)
    a = tokens(2 * BS + 1, seed=8)
    run(llm, a, ONE_TOKEN)
    outs = llm.generate(
        [tokens(3 * BS, seed=9), tokens(4 * BS, seed=10)], ONE_TOKEN, use_tqdm=False
    )
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert cached_blocks(llm, a) == [True, False]
    _, hit = run(llm, a, ONE_TOKEN)
    assert hit == BS
    assert_idle(llm)


HASH_SCRIPT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("block_pool", sys.argv[1])
bp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bp)
token_ids, bs = json.loads(sys.argv[2]), int(sys.argv[3])
out = []
for salt in (b"", b"salt"):
    parent, chain = None, []
    for i in range(len(token_ids) // bs):
        parent = bp.hash_block(parent, token_ids[i * bs : (i + 1) * bs], salt)
        chain.append(parent.hex())
    out.append(chain)
print(json.dumps(out))
"""


def test_block_hashes_are_stable_across_processes():
    token_ids = tokens(4 * BS + 3, seed=11) + [2**40, 0, 255]
    in_process = []
    for salt in (b"", b"salt"):
        req = Request("r", token_ids, SamplingParams(), set(), 10_000, 0, salt, BS)
        in_process.append([h.hex() for h in req.full_block_hashes()])
    assert len(in_process[0]) == 4 and in_process[0] != in_process[1]
    argv = [engine.block_pool.__file__, json.dumps(token_ids), str(BS)]
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", HASH_SCRIPT, *argv],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert json.loads(proc.stdout) == in_process, f"PYTHONHASHSEED={seed}"


def test_preemption_recomputes_through_the_cache(model_dir):
    # A pool too small for the batch: requests are preempted, then readmitted with hits on
    # their own freed blocks. Outputs must equal a roomy pool's with no caching at all.
    rng = random.Random(0)
    base = tokens(40, seed=12)
    prompts = [base[: rng.randrange(1, 40)] + tokens(rng.randrange(20), seed=i) for i in range(6)]
    params = [
        SamplingParams(n=rng.choice([1, 2]), temperature=0, max_tokens=24, ignore_eos=True)
        for _ in prompts
    ]
    roomy = LLM(model_dir, num_kv_blocks=200, block_size=4, enable_prefix_caching=False)
    expected = [ids(o) for o in roomy.generate(prompts, params, use_tqdm=False)]
    llm = LLM(model_dir, num_kv_blocks=30, block_size=4)
    assert [ids(o) for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    snap = llm.engine.snapshot()
    assert snap["num_preemptions"] > 0 and snap["prefix_cache"]["hit_tokens"] > 0
    assert_idle(roomy)
    assert_idle(llm)


def test_diverging_siblings_copy_the_shared_block_on_write(model_dir):
    # n = 3 siblings share the prompt's blocks, including its partly filled last block, and
    # sample different tokens into it: each must read only its own. Sibling i samples with
    # seed + 1_000_003 * i, so it must equal a lone n = 1 request with that seed.
    llm = LLM(model_dir, num_kv_blocks=40, block_size=BS)
    prompt = tokens(2 * BS + 3, seed=13)

    def sampled(n: int, seed: int) -> SamplingParams:
        return SamplingParams(n=n, seed=seed, temperature=1.5, max_tokens=12, ignore_eos=True)

    (group,) = llm.generate([prompt], sampled(3, 7), use_tqdm=False)
    alone = [
        llm.generate([prompt], sampled(1, 7 + 1_000_003 * i), use_tqdm=False)[0] for i in range(3)
    ]
    assert len({tuple(c.token_ids) for c in group.outputs}) == 3
    assert ids(group) == [ids(o)[0] for o in alone]
    assert [o.num_cached_tokens for o in alone] == [2 * BS] * 3
    assert_idle(llm)
