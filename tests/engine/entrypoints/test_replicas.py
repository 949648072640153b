"""Data-parallel replicas on a local Ray Serve instance: two SmolLM2 engines behind one server.

Outputs equal one engine's; the prefix-aware router beats round-robin on the prefix-cache hit
rate of a shared-system-prompt workload; a replica that dies fails its requests with an error
and is replaced."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from web import API_KEY, command_line, serving

from engine.config import EngineConfig
from engine.entrypoints.beam_search import BeamSearchParams
from engine.entrypoints.openai.server import ServerState, build_app
from engine.entrypoints.routing import ReplicaView, Submission, prompt_hashes, rank
from engine.sampling_params import SamplingParams
from lora.adapter import LoRARequest

ray = pytest.importorskip("ray", reason="the [distributed] extra (make test installs it)")
from ray import serve  # noqa: E402

from engine.entrypoints.replicas import ROUTING_STATS_PERIOD_S, Replicas  # noqa: E402

MODEL = "smollm2-135m-instruct"
SYSTEM_TOKENS = 160  # 10 blocks of 16
NUM_KV_BLOCKS = 26  # one replica holds two system prompts' blocks and a request, not three


def replica_config() -> EngineConfig:
    return EngineConfig(
        model=MODEL,
        quantization=None,
        num_threads=1,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_model_len=380,
        enable_lora=True,
    )


def test_serve_command_with_two_replicas(offline):
    """`tandem serve --data-parallel-size 2` as a user starts it (its own Ray instance; run
    before this module starts one): answers as the offline API on one engine does, and /metrics
    shows both replicas and their sum. Two requests at once: the second goes to the idle
    replica, so both count tokens."""
    extra = ("--data-parallel-size", "2", "--quantization", "none", "--max-model-len", "512")
    with command_line("serve", MODEL, *extra) as (url, _), ThreadPoolExecutor(2) as pool:
        args = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
        sent = [pool.submit(_client(url).completions.create, **args) for _ in range(2)]
        r, r2 = (f.result() for f in sent)
        deadline = time.monotonic() + 30
        while len(replicas := _per_replica(url, "tandem_generation_tokens_total")) < 3:
            assert time.monotonic() < deadline, replicas
            time.sleep(0.5)
    params = SamplingParams(temperature=0, max_tokens=8)
    (want,) = offline.generate("The capital of France is", params, use_tqdm=False)
    assert r.choices[0].text == r2.choices[0].text == want.outputs[0].text
    total = replicas.pop("all")
    assert len(replicas) == 2 and total == sum(replicas.values()) >= 16
    assert all(n >= 8 for n in replicas.values()), replicas


def test_bad_data_parallel_size_is_refused():
    """A replica count below 1 names the flag; the playground (one engine's views) refuses
    replicas; neither starts Ray."""
    from playground.cli import main

    with pytest.raises(SystemExit, match="--data-parallel-size must be >= 1, got 0"):
        main(["serve", "--data-parallel-size", "0"])
    with pytest.raises(SystemExit, match="the playground draws one engine"):
        main(["playground", "--data-parallel-size", "2"])
    assert not ray.is_initialized()


def _per_replica(url: str, sample: str) -> dict[str, float]:
    """A sample's values in /metrics by its replica label."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return {
        s.labels["replica"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample and "replica" in s.labels
    }


@contextmanager
def deployment(app: str, policy: str, adapters=(), lora_dir=None):
    """Two replicas behind the OpenAI server; yields (URL, Replicas)."""
    replicas = Replicas.start(replica_config(), 2, list(adapters), policy=policy, app=app)
    loaded = {a.name: a for a in adapters}
    state = ServerState(replicas, MODEL, loaded, api_keys=(API_KEY,), lora_dir=lora_dir)
    try:
        with serving(build_app(state)) as url:
            yield url, replicas
    finally:
        replicas.shutdown()


@pytest.fixture(scope="module")
def ray_cluster():
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def prefix(ray_cluster, demo_adapters):
    adapters = list(demo_adapters.values())
    folder = Path(adapters[0].path).parent  # adapters may be hot-loaded from here
    with deployment("prefix", "prefix", adapters[:1], lora_dir=folder) as served:
        yield served


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)


# A Ray client's first call to the instance's GCS: what it prints is what it got.
RAY_PROBE = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_keys(b"", namespace=None, timeout=10)
    print("served")
except Exception as exc:
    print(type(exc).__name__)
"""


def test_the_local_ray_instance_takes_no_client_without_its_token(prefix):
    """The Ray instance the server started answers only its own random token: a client with
    Ray's default token (~/.ray/auth_token, which every local user can read and any other
    local instance shares), a wrong one, or none is refused; one with the server's is served
    (Ray listens on every interface: the token is the lock)."""
    gcs = ray.get_runtime_context().gcs_address
    ours = os.environ["RAY_AUTH_TOKEN"]
    assert len(ours) == 64 and os.environ["RAY_AUTH_MODE"] == "token"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    cases = {
        "default token": {"RAY_AUTH_MODE": "token"},
        "wrong token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
        "no token": {"RAY_AUTH_MODE": "disabled"},
        "the server's token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": ours},
    }

    def probe(env: dict) -> str:
        import subprocess
        import sys

        argv = [sys.executable, "-c", RAY_PROBE, gcs]
        done = subprocess.run(argv, env=clean | env, capture_output=True, text=True, timeout=120)
        return done.stdout.strip()

    with ThreadPoolExecutor(len(cases)) as pool:
        got = dict(zip(cases, pool.map(probe, cases.values()), strict=True))
    assert got["the server's token"] == "served", got
    assert got["wrong token"] == got["no token"] == "AuthenticationError", got
    assert got["default token"] != "served", got


def test_outputs_equal_one_engine(prefix, offline, demo_adapters):
    """Greedy and seeded sampled completions, their logprobs, an adapter's, and beam search
    (on one replica), as the offline API gives them from one engine."""
    client = _client(prefix[0])
    prompts = ["The cat sat on the mat. The cat sat", "One, two, three,"]
    for temperature, seed in ((0.0, None), (0.8, 11)):
        r = client.completions.create(
            model=MODEL,
            prompt=prompts,
            max_tokens=10,
            temperature=temperature,
            seed=seed,
            logprobs=2,
        )
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=10, logprobs=2)
        refs = offline.generate(prompts, params, use_tqdm=False)
        for got, ref in zip(r.choices, refs, strict=True):
            want = ref.outputs[0]
            assert got.text == want.text and len(want.token_ids) == 10
            values = [lp[t].logprob for lp, t in zip(want.logprobs, want.token_ids, strict=True)]
            assert got.logprobs.token_logprobs == pytest.approx(values, rel=1e-4, abs=1e-5)
    name, adapter = next(iter(demo_adapters.items()))
    prompt = "Once upon a time"
    r = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0)
    params = SamplingParams(temperature=0, max_tokens=16)
    (ref,) = offline.generate(prompt, params, use_tqdm=False, lora_request=adapter)
    (base,) = offline.generate(prompt, params, use_tqdm=False)
    assert r.choices[0].text == ref.outputs[0].text != base.outputs[0].text
    beams = ["The three primary colours are", "A good name for a cat is"]
    beam_args = {"use_beam_search": True, "best_of": 3}
    r = client.completions.create(
        model=MODEL, prompt=beams, max_tokens=12, n=2, extra_body=beam_args
    )
    want = [
        s for out in offline.beam_search(beams, BeamSearchParams(3, 12)) for s in out.sequences[:2]
    ]
    assert [c.text for c in r.choices] == [s.text for s in want]


def test_adapter_hot_load_reaches_every_replica(prefix, offline, demo_adapters):
    """An adapter loaded over HTTP is loaded on both replicas (each reports it) and serves
    as offline; unloaded, it is gone from both and its name is a 404."""
    url, replicas = prefix
    headers = {"Authorization": f"Bearer {API_KEY}"}
    name, adapter = list(demo_adapters.items())[1]
    body = {"lora_name": "hot", "lora_path": Path(adapter.path).name}
    r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert all("hot" in rep["adapters"] for rep in replicas.reports().values())
    params = SamplingParams(temperature=0, max_tokens=12)
    hot = LoRARequest("hot", adapter.path)
    (ref,) = offline.generate("One, two,", params, use_tqdm=False, lora_request=hot)
    for _ in range(2):
        r = _client(url).completions.create(
            model="hot", prompt="One, two,", max_tokens=12, temperature=0
        )
        assert r.choices[0].text == ref.outputs[0].text
    body = {"lora_name": "hot"}
    r = httpx.post(url + "/v1/unload_lora_adapter", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert not any("hot" in rep["adapters"] for rep in replicas.reports().values())
    with pytest.raises(openai.NotFoundError):
        _client(url).completions.create(model="hot", prompt="One", max_tokens=2)


def _hit_tokens(url: str) -> tuple[float, float]:
    """(hit tokens, query tokens) summed over replicas (replica="all" in /metrics)."""
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def total(name: str) -> float:
        samples = families[name].samples
        return next(s.value for s in samples if s.labels.get("replica") == "all")

    return total("tandem_prefix_cache_hits"), total("tandem_prefix_cache_queries")


def _reported(replicas: Replicas) -> None:
    """Wait until both replicas answer, and the router's picture of them is current (their
    reports reach it every ROUTING_STATS_PERIOD_S)."""
    deadline = time.monotonic() + 30
    while len(replicas.summaries()) < 2:
        assert time.monotonic() < deadline, replicas.reports()
        time.sleep(0.1)
    time.sleep(3 * ROUTING_STATS_PERIOD_S)


def _shared_prefix_run(url: str, replicas: Replicas) -> float:
    """Three system prompts of 10 blocks in turn, 4 rounds, each with its own question; a
    round's three requests in flight together (sent 50 ms apart, in order); the prefix-cache
    hit rate over the run."""
    vocab = replicas.engine.vocab_size
    systems = [
        [(97 * s + 13 * i) % (vocab - 1000) + 500 for i in range(SYSTEM_TOKENS)] for s in range(3)
    ]
    client = _client(url)
    _reported(replicas)
    hits0, queries0 = _hit_tokens(url)
    with ThreadPoolExecutor(len(systems)) as pool:
        for round_ in range(4):
            sent = []
            for s, system in enumerate(systems):
                question = [700 + 10 * round_ + s + k for k in range(8)]
                prompt = system + question
                sent.append(
                    pool.submit(
                        client.completions.create,
                        model=MODEL,
                        prompt=prompt,
                        max_tokens=4,
                        temperature=0,
                    )
                )
                time.sleep(0.05)
            for future in sent:
                assert future.result().choices[0].finish_reason == "length"
    _reported(replicas)
    hits, queries = _hit_tokens(url)
    return (hits - hits0) / (queries - queries0)


def test_prefix_routing_beats_round_robin(prefix, ray_cluster):
    """The same workload through the prefix-aware router and through round-robin: each
    replica holds two of the three system prompts at most, so round-robin (every replica sees
    all three, in turn) evicts what it needs next, while the prefix router keeps each prompt
    on one replica."""
    with deployment("round-robin", "round_robin") as (url, replicas):
        round_robin = _shared_prefix_run(url, replicas)
    prefix_aware = _shared_prefix_run(*prefix)
    print(f"prefix-cache hit rate: prefix-aware {prefix_aware:.3f}, round-robin {round_robin:.3f}")
    assert prefix_aware > round_robin + 0.4, (prefix_aware, round_robin)
    # 9 of 12 requests find their 160-token system prompt cached
    assert prefix_aware >= 0.9 * 9 * SYSTEM_TOKENS / (12 * (SYSTEM_TOKENS + 8))


def test_replica_death_fails_its_requests_and_is_replaced(prefix):
    url, replicas = prefix
    client = _client(url)
    stream = client.completions.create(
        model=MODEL,
        prompt="Count: 1, 2, 3,",
        max_tokens=300,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)  # it runs
    deadline = time.monotonic() + 10
    while not (busy := [r for r in replicas.reports().values() if r.get("load")]):
        assert time.monotonic() < deadline, "no replica reported the request"
        time.sleep(0.1)
    pid = busy[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIError) as failed:
        for _ in chunks:
            pass
    assert time.monotonic() - started < 30
    assert "stopped" in str(failed.value)
    deadline = time.monotonic() + 120
    while True:  # Ray Serve starts a new replica in its place
        pids = {r.get("pid") for r in replicas.reports().values()}
        if len(pids) == 2 and pid not in pids and replicas.is_running:
            break
        assert time.monotonic() < deadline, pids
        time.sleep(0.5)
    for _ in range(4):  # both serve
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason == "length"
    assert httpx.get(url + "/health").status_code == 200


def _view(key, cached=(), adapters=None, load=0) -> ReplicaView:
    return ReplicaView(key, set(cached), adapters or {}, load)


def test_rank_rules():
    """Longest cached prefix first; too busy a replica is passed over; no match: least
    loaded, then fewest cached blocks; a LoRA request prefers replicas with its adapter and
    matches with the adapter's cache key."""
    prompt = list(range(100, 164))  # 4 blocks of 16
    sub = Submission("r", prompt, SamplingParams())
    h = prompt_hashes(sub, 16, None)
    views = [_view("a", h[:1]), _view("b", h[:3]), _view("c")]
    assert rank(views, sub, 16) == ([["b"], ["a", "c"]], "prefix")
    views[1].load = 10  # b is far busier than the least loaded: not eligible
    assert rank(views, sub, 16) == ([["a"], ["b", "c"]], "prefix")
    assert rank(views, sub, 16, min_blocks=2) == ([["c"], ["a", "b"]], "least_loaded")
    fresh = [_view("a", [b"x"] * 1), _view("b", [b"y", b"z"]), _view("c", [b"w"], load=1)]
    assert rank(fresh, sub, 16)[0][0] == ["a"]  # idle and the smallest cache
    lora = Submission("r", prompt, SamplingParams(), LoRARequest("sql", "/x"))
    key = b"\x00lora:sql@v1"
    keyed = prompt_hashes(lora, 16, key)
    views = [_view("a", h), _view("b", keyed[:2], {"sql": key}), _view("c", (), {"sql": key})]
    assert rank(views, lora, 16) == ([["b"], ["a", "c"]], "prefix")
    views[1].cached = set(h)  # base-model blocks do not serve the adapter's requests
    assert rank(views, lora, 16) == ([["c"], ["a", "b"]], "adapter")  # c caches least
