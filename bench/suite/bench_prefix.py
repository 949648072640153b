"""The prefix cache (bench/shared_prefix.py): one request whose long shared prefix is already in
the cache (from an earlier request with another tail) against the same request with prefix
caching off, time to first token and the request's total seconds, greedy, EOS ignored. Every
round's tokens must be equal between the two, and the cached request must have found the
prefix's whole blocks in the cache. Quick: a 1024-token prefix at 1 thread; full: prefixes of
512, 1024 and 2048 tokens at 1 and 2 threads."""

from __future__ import annotations

import functools

import pytest

from bench import shared_prefix
from bench.suite.common import quick, record, repeats

TAIL = 24  # each request's own tokens after the shared prefix
MAX_TOKENS = 16


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    fast = quick(metafunc.config)
    if "prefix_len" in metafunc.fixturenames:
        metafunc.parametrize(
            "prefix_len",
            [1024] if fast else [512, 1024, 2048],
            ids=lambda n: f"p{n}",
            scope="module",
        )
    if "threads" in metafunc.fixturenames:
        metafunc.parametrize(
            "threads", [1] if fast else [1, 2], ids=lambda n: f"t{n}", scope="module"
        )


@functools.cache
def measured(prefix_len: int, threads: int, rounds: int):
    return shared_prefix.measure_cached(prefix_len, threads, TAIL, MAX_TOKENS, rounds)


@pytest.mark.parametrize("metric", ["ttft", "total"])
@pytest.mark.parametrize("mode", ["cold", "cached"])
def test_prefix(benchmark, request, mode, metric, prefix_len, threads):
    timings = measured(prefix_len, threads, repeats(request.config))
    problems = shared_prefix.cached_problems(timings)
    assert not problems, "; ".join(problems)
    extra = {"prefix_tokens": prefix_len, "threads": threads, "equal_cold_cached": True}
    group = f"prefix-{metric}-p{prefix_len}-t{threads}"
    record(benchmark, group, timings[mode], metric, **extra)
