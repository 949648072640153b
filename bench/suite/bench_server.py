"""The HTTP server (bench/server.py): time to first token, time per output token and wall
seconds for the same requests, all submitted at once, through `tandem serve` (a subprocess on a
free port, streaming AsyncOpenAI clients) and offline (the engine in this process). The full run
also times whole (stream=False) responses, and has 32 requests of the throughput workload's
shape instead of 8 short ones."""

from __future__ import annotations

import functools

import pytest

from bench import server
from bench.suite.common import quick, record, repeats

MODES = ["offline", "server", "server-whole"]
METRICS = ["ttft", "tpot", "seconds"]


def num_requests(config) -> int:
    return 8 if quick(config) else 32


@functools.cache
def measured(requests: int, rounds: int, fast: bool):
    """Every mode alternated; the server process lives inside this call only."""
    wl = server.build_workload(requests, 0, quick=fast)
    return wl, server.measure(wl, rounds, whole=not fast)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("mode", MODES)
def test_server(benchmark, request, mode, metric):
    config = request.config
    requests = num_requests(config)
    wl, timings = measured(requests, repeats(config), quick(config))
    if mode not in timings:
        pytest.skip("full run only")
    if metric not in timings[mode].runs[-1].metrics:
        pytest.skip(f"{mode} has no {metric} (whole responses: wall seconds only)")
    bad = server.mismatches(timings)
    if mode in bad:
        pytest.fail(f"{mode} against offline: {server.describe(timings, mode, bad[mode])}")
    extra = {
        "requests": requests,
        "prompt_tokens": wl.num_prompt_tokens,
        "output_tokens": wl.num_output_tokens,
        "equal_to_offline": True,  # checked above for every mode
        "tokens_per_s": round(wl.num_output_tokens / timings[mode].median("seconds"), 2),
    }
    record(benchmark, f"server-{metric}-r{requests}", timings[mode], metric, **extra)
