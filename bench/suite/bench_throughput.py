"""Batched throughput (bench/throughput.py): wall seconds for a whole workload of requests with
lognormal prompt and output lengths, ours with every request submitted at once against HF
static batching and HF continuous batching on the same requests, greedy, EOS ignored, prefix
caching off. Quick: the small workload (16 requests) at 1 thread; full: the "quick" workload (24
longer requests) at 1 and 2 threads. The 64-request workload (its HF sides take ~11 minutes a
round on one thread) and HF one request at a time (hf_seq) stay in the script
(`python -m bench.throughput [--modes tandem,hf_seq]`), too slow for the suite."""

from __future__ import annotations

import functools

import pytest

from bench import throughput
from bench.suite.common import quick, record, repeats

MODES = ["tandem", "hf_static", "hf_cb"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "threads" in metafunc.fixturenames:
        metafunc.parametrize(
            "threads",
            [1] if quick(metafunc.config) else [1, 2],
            ids=lambda n: f"t{n}",
            scope="module",
        )


def size(config) -> str:
    return "small" if quick(config) else "quick"


@functools.cache
def measured(size: str, threads: int, rounds: int):
    wl = throughput.build_workload(size)
    batch_size = throughput.SIZES[size][3]
    return wl, throughput.measure(wl, threads, rounds, MODES, batch_size)


@pytest.mark.parametrize("mode", MODES)
def test_throughput(benchmark, request, mode, threads):
    config = request.config
    wl, timings = measured(size(config), threads, repeats(config))
    ours, theirs = timings["tandem"], timings[mode]
    assert theirs.info["output_tokens"] == wl.num_output_tokens, f"{mode}: wrong output lengths"
    extra = {"workload": size(config), "threads": threads, "prompt_tokens": wl.num_prompt_tokens}
    extra["tok_s"] = round(theirs.median("tok_s"), 2)
    if mode != "tandem":
        found = throughput.divergences(ours.outputs, theirs.outputs)
        assert not found, f"{mode} against tandem, (request, first differing token): {found}"
        extra["equal_to_tandem"] = True
    record(benchmark, f"throughput-t{threads}", theirs, "seconds", **extra)
