"""Tensor parallelism (engine.distributed.tensor_parallel) on CPU: two ranks over gloo, tiny models.

Greedy tokens must equal one rank's exactly (peaked random weights: the all-reduce's different
summation order moves logits by float rounding, far below the gap between the top two tokens),
logprobs within 1e-4 of one rank's, through chunked prefill, preemption, speculation and a
grammar; a worker that dies fails the engine at once instead of hanging it.
"""

from __future__ import annotations

import math
import time

import httpx
import psutil
import pytest
import torch
import torch.distributed as dist
from grammar_cases import CONSTRAINTS
from web import API_KEY, command_line, make_state, serving

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.entrypoints.openai.server import build_app

# Mixed lengths; the 60-token prompt is prefilled in chunks of 16, and 40 blocks of 4 tokens
# cannot hold the batch at full length (preemption). The tiny model continues the two phrases
# that repeat, so prompt lookup's drafts are accepted there.
PROMPTS = [[7, 8, 9, 10] * 15, [10, 201, 39, 37] * 5, [100 + i for i in range(11)], [84, 182] * 8]
CONFIG = dict(num_threads=1, block_size=4, num_kv_blocks=40, max_num_batched_tokens=16)


def generate(model, constraints=False, **config) -> tuple[LLM, list]:
    llm = LLM(str(model), **CONFIG, **config)
    params = [
        SamplingParams(
            max_tokens=24,
            temperature=0,
            ignore_eos=True,
            logprobs=2,
            prompt_logprobs=2 if i == 0 else None,  # rows across the prefill's chunks
            structured_outputs=CONSTRAINTS[i] if constraints else None,
        )
        for i in range(len(PROMPTS))
    ]
    # two seeded samples of one prompt: forks sharing its blocks, copy-on-write of the last
    sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=5, n=2, ignore_eos=True)
    return llm, llm.generate([*PROMPTS, [3, 1, 4, 1, 5, 9]], [*params, sampled], use_tqdm=False)


def assert_same(outs, reference, tolerance: float = 1e-4) -> None:
    *greedy, sampled = zip(outs, reference, strict=True)
    assert [c.token_ids for c in sampled[0].outputs] == [c.token_ids for c in sampled[1].outputs]
    for out, ref in greedy:
        got, want = out.outputs[0], ref.outputs[0]
        assert got.token_ids == want.token_ids
        prompt = (out.prompt_logprobs or [None])[1:], (ref.prompt_logprobs or [None])[1:]
        for lps, ref_lps in zip(got.logprobs + prompt[0], want.logprobs + prompt[1], strict=True):
            assert lps.keys() == ref_lps.keys()
            for t in lps:
                assert math.isclose(lps[t].logprob, ref_lps[t].logprob, abs_tol=tolerance)


def test_logits_gather_pads_uneven_shares():
    """Two ranks (threads here) holding 3 and 2 of 5 vocabulary rows: rank 0 gets the logits
    side by side, the padding cut off."""
    from engine.models.parallel import vocab_rows

    assert [vocab_rows(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [vocab_rows(10, r, 3) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]
    whole = torch.arange(20.0).reshape(4, 5)

    def rank(group) -> torch.Tensor:
        start, end = vocab_rows(5, group.rank, 2)
        return group.gather_columns(whole[:, start:end].clone(), 5)

    got = two_ranks(rank, b"token", b"token")
    assert torch.equal(got[0], whole)


def two_ranks(fn, token0: bytes, token1: bytes) -> dict:
    """fn(group) on two ranks (threads) meeting as the engine's do; each rank's result, or the
    exception it raised."""
    import threading

    from engine.distributed.tensor_parallel import HOST, TIMEOUT, Group, local_store

    store = local_store(2)
    got = {}

    def rank(r: int, token: bytes) -> None:
        peer = store if r == 0 else dist.TCPStore(HOST, store.port, 2, timeout=TIMEOUT)
        try:
            got[r] = fn(Group(peer, r, 2, token))
        except Exception as exc:  # noqa: BLE001 (returned to the test)
            got[r] = exc

    threads = [threading.Thread(target=rank, args=(r, t)) for r, t in ((0, token0), (1, token1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


UNPICKLED: list[str] = []


def _unpickled() -> str:
    UNPICKLED.append("ran")
    return "unpickled"


class Payload:
    """What rank 0 broadcasts: unpickling it runs _unpickled (as a hostile pickle would run
    its code)."""

    def __reduce__(self):
        return _unpickled, ()


@pytest.mark.parametrize("case", ["same token", "wrong token", "out of turn"])
def test_broadcasts_from_a_peer_without_the_token_are_refused_unread(case):
    """A worker unpickles only what was signed with its group's token for that turn: another
    token, or a signed message replayed out of turn, is a RendezvousError and nothing of it is
    unpickled (before, any peer that reached the store could send a pickle)."""
    from engine.distributed.tensor_parallel import RendezvousError

    def rank(group):
        if case == "out of turn" and group.rank == 1:
            group.num_broadcasts = 1  # rank 0 signs its first message as number 0
        return group.broadcast(Payload() if group.rank == 0 else None)

    UNPICKLED.clear()
    other = b"other-token" if case == "wrong token" else b"rank-0-token"
    got = two_ranks(rank, b"rank-0-token", other)
    if case == "same token":
        assert got[1] == "unpickled" and UNPICKLED == ["ran"]
    else:
        assert isinstance(got[1], RendezvousError), got[1]
        assert "not signed with this group's token" in str(got[1])
        assert UNPICKLED == []
    assert isinstance(got[0], Payload)  # rank 0 keeps its own object


def test_the_rendezvous_listens_on_loopback_only():
    """The store and gloo's connections listen on 127.0.0.1 alone (TCPStore's own listener took
    every interface: *:port)."""
    from engine.distributed.tensor_parallel import local_store

    def listening() -> set[tuple[str, int]]:
        return {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN
        }

    before = listening()
    store = local_store(2)
    assert {ip for ip, port in listening() if port == store.port} == {"127.0.0.1"}

    def rank(group) -> set[tuple[str, int]]:
        group.all_reduce(torch.ones(2))
        return listening()  # with both ranks' gloo connections up

    during = two_ranks(rank, b"t", b"t")[0]
    opened = during - before - {("127.0.0.1", store.port)}
    assert len(opened) >= 2 and {ip for ip, _ in opened} == {"127.0.0.1"}, opened


def is_worker(process: psutil.Process) -> bool:
    return "from engine.distributed.tensor_parallel import worker" in " ".join(process.cmdline())


def assert_idle(llm) -> None:
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_two_ranks_equal_one(arch, request):
    """Each rank holds half the heads (and half of every KV block); greedy tokens equal one
    rank's and logprobs agree within 1e-4, through chunked prefill and preemption."""
    model = request.getfixturevalue(arch)
    _, reference = generate(model, enable_prefix_caching=False)
    llm, outs = generate(model, enable_prefix_caching=False, tensor_parallel_size=2)
    assert llm.engine.runner.kv_caches.shape[2] == 1  # of the 2 KV heads
    model_ = llm.engine.runner.model  # rank 0 computes half the vocabulary's logits
    assert model_.lm_head.format.weight.shape[0] == -(-model_.config.vocab_size // 2)
    assert len(outs[0].prompt_logprobs) == len(PROMPTS[0])
    # (a split weight that required grad chained every step's graph onto the KV cache)
    assert not any(p.requires_grad for p in llm.engine.runner.model.parameters())
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same(outs, reference)
    assert_idle(llm)
    llm.engine.workers.close()


@pytest.mark.parametrize(
    ("bits", "kv_cache_dtype"), [("int4", "auto"), ("int8", "auto"), ("int4", "int8")]
)
def test_two_ranks_quantized(tiny_llama, bits, kv_cache_dtype):
    """Weight-only quantized projections split by whole groups of 32 inputs: the same codes as
    one rank's, so the same tokens; logprobs within 0.05 (activations are quantized to int8 per
    32 values, where a rounding difference of the all-reduce can move one code: int4 weights
    differed by up to 0.035, int8 by 2e-6). Both run the C++ layers' pieces; the split layers
    with an all-reduce between the halves. With an int8 KV cache each rank quantizes the rows
    of its own KV heads (half of every block) as one rank would, against one rank's int8
    cache."""
    kw = dict(quantization=bits, kv_cache_dtype=kv_cache_dtype)
    _, reference = generate(tiny_llama, **kw)
    llm, outs = generate(tiny_llama, tensor_parallel_size=2, **kw)
    assert llm.engine.runner.model.layers[0].self_attn.o_proj.format.in_features == 32  # of 64
    if kv_cache_dtype == "int8":
        caches = llm.engine.runner.kv_caches
        assert caches.dtype == torch.int8 and caches.k.shape[1] == caches.v.shape[1] == 1  # of 2
        assert llm.engine.snapshot()["kv_cache_dtype"] == "int8"
    assert_same(outs, reference, tolerance=0.05)
    assert_idle(llm)
    llm.engine.workers.close()


@pytest.mark.parametrize(
    "mode",
    [
        dict(speculative_method="ngram"),
        dict(draft="draft_model"),
        dict(draft="tiny_llama", draft_quantization=None),
        dict(constraints=True),
    ],
    ids=["ngram", "draft-model", "self-draft", "grammar"],
)
def test_two_ranks_with_speculation_and_grammar(tiny_llama, mode, request):
    """n-gram drafts, draft models (whole on rank 0: another model, and the target's own
    weights) and grammar masks with forced drafts on the split target:
    the same tokens and the same drafts and acceptances as one rank with the same settings."""
    mode = dict(mode, adaptive_speculation=False)  # a fixed k: the same drafts on both
    if "draft" in mode:
        mode["draft_model"] = str(request.getfixturevalue(mode.pop("draft")))
    one, reference = generate(tiny_llama, **mode)
    llm, outs = generate(tiny_llama, tensor_parallel_size=2, **mode)
    assert_same(outs, reference)
    counts = [
        (s.num_drafts, s.num_accepted, s.num_forced)
        for s in (one.engine.speculation.stats, llm.engine.speculation.stats)
    ]
    assert counts[0] == counts[1]
    drafts, accepted, forced = counts[1]
    assert drafts + forced > 0  # multi-token steps verified on the split target
    if mode.get("speculative_method") or mode.get("draft_model") == str(tiny_llama):
        assert accepted > 0  # (the other draft model's drafts all miss)
    assert_idle(llm)
    llm.engine.workers.close()


def test_two_ranks_with_lora(tiny_llama, tmp_path):
    """Adapters on every projection split with their layers (B by output for QKV and gate/up,
    A by input for o_proj and down_proj): each request's tokens equal one rank's with the same
    adapter. One slot for two adapters: slots are rewritten step after step on every rank."""
    from lora.adapter import LoRARequest
    from models import make_adapter

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    a, b = (
        LoRARequest(name, str(make_adapter(tiny_llama, tmp_path / name, seed, 8, targets, {})))
        for seed, name in enumerate("ab")
    )
    loras = [a, b, None, a, b]
    prompts = [*PROMPTS, [3, 1, 4, 1, 5, 9]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    config = dict(CONFIG, enable_lora=True, max_loras=1, max_lora_rank=8)
    outs = []
    for ranks in (1, 2):
        llm = LLM(str(tiny_llama), tensor_parallel_size=ranks, **config)
        got = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        outs.append([o.outputs[0].token_ids for o in got])
        assert llm.engine.runner.lora_slots.num_loads > 2  # the one slot was rewritten
    assert outs[0] == outs[1]
    base = LLM(str(tiny_llama), **CONFIG).generate(prompts, params, use_tqdm=False)
    changed = [o.outputs[0].token_ids != t for o, t in zip(base, outs[1], strict=True)]
    assert changed == [lora is not None for lora in loras]
    llm.engine.workers.close()


def test_dead_worker_fails_the_server_not_hangs(tiny_llama):
    """A worker killed mid-service: the next request gets a 503 within seconds, /health says
    503, and the error names the worker."""
    state = make_state(str(tiny_llama), num_kv_blocks=64, tensor_parallel_size=2)
    engine = state.engine.engine
    with serving(build_app(state)) as url:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"model": str(tiny_llama), "prompt": "hi", "max_tokens": 4}
        ok = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert ok.status_code == 200
        engine.workers.procs[0].kill()
        engine.workers.procs[0].wait()
        start = time.monotonic()
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 503
        assert time.monotonic() - start < 30
        assert httpx.get(url + "/health").status_code == 503
    with pytest.raises(RuntimeError, match="tensor-parallel worker 1 exited"):
        engine.workers.copy_blocks([(1, 2)])
    engine.workers.close()


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer in"),
        (dict(tensor_parallel_size=2, async_scheduling=True), "does not support async_sched"),
    ],
)
def test_config_errors_name_the_setting(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**config)


def test_heads_must_divide(tiny_llama):
    """4 query heads and 2 KV heads do not split 3 ways: refused, and no worker is left."""
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide .* heads"):
        LLM(str(tiny_llama), num_kv_blocks=16, num_threads=1, tensor_parallel_size=3)
    workers = [p for p in psutil.Process().children() if is_worker(p)]
    assert workers == []


def test_serve_command_with_two_ranks(tiny_llama):
    """`tandem serve --tensor-parallel-size 2`: answers as the offline API on one rank does, and
    its worker leaves with it."""
    import openai

    with command_line("serve", str(tiny_llama), "--tensor-parallel-size", "2") as (url, proc):
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 1 and is_worker(workers[0])
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        r = client.completions.create(
            model=str(tiny_llama), prompt="abcdef", max_tokens=12, temperature=0
        )
    offline = LLM(str(tiny_llama), num_kv_blocks=64, num_threads=1)
    want = offline.generate("abcdef", SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert r.choices[0].text == want[0].outputs[0].text
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert alive == []


def test_gguf_split_three_ways_meets_the_quality_rule_and_a_broken_shard_does_not():
    """SmolLM2's own GGUF blocks split over 3 ranks (9 heads, 3 KV heads, 1536 MLP columns; the
    row-split inputs, 192 and 512, are whole groups of 32): teacher-forced over 1023 positions
    of real text it meets the quantized weights' rule (perplexity within 1%, top-1 agreement
    >= 95%) against the exact fp32 model on one rank; with rank 0's zero points moved one step
    (a shard loaded wrong) it fails the same rule."""
    from test_quantized import assert_rule_holds_then_breaks

    from bench.quality import held_tokens, teacher_forced

    exact = LLM("smollm2-135m-instruct", quantization=None, num_threads=1, num_kv_blocks=200)
    ids = held_tokens(exact.tokenizer, 1024)
    reference = teacher_forced(exact, ids)
    llm = LLM("smollm2-135m-instruct", num_threads=1, num_kv_blocks=200, tensor_parallel_size=3)
    o_proj = llm.engine.runner.model.layers[0].self_attn.o_proj
    assert o_proj.format.in_features == 192  # of 576
    assert_rule_holds_then_breaks(llm, ids, reference, 1023)
    llm.engine.workers.close()
