"""Speculation at batch 1 / 4 / 16 / 64 (bench/speculative.py's sweep): n-gram on SmolLM2, no
speculation (plain) against a fixed k = 4 and adaptive k (cap 4), wall seconds for the whole
batch, every request generating the same number of tokens (EOS ignored). Workloads: "mixed"
(half input-grounded prompts, where drafts land, half open-ended) and, in the full run, "open"
(open-ended only, where speculation must not cost much). Quick: mixed at batch 1 and 4, 32
tokens a request (at batch 16 so few tokens would time mostly the prompts' prefill); full: both
workloads at every batch size, 64 tokens. fixed and adaptive must
equal plain token for token. Groups: speculation-<workload>-b<batch>."""

from __future__ import annotations

import functools

import pytest

from bench import speculative
from bench.harness import first_difference
from bench.suite.common import quick, record, repeats

K = 4


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    fast = quick(metafunc.config)
    if "workload" in metafunc.fixturenames:
        metafunc.parametrize("workload", ["mixed"] if fast else ["mixed", "open"], scope="module")
    if "batch" in metafunc.fixturenames:
        sizes = batches(metafunc.config)
        metafunc.parametrize("batch", sizes, ids=lambda n: f"b{n}", scope="module")


def batches(config) -> tuple[int, ...]:
    return (1, 4) if quick(config) else (1, 4, 16, 64)


def tokens(config) -> int:
    return 32 if quick(config) else 64


@functools.cache
def measured(workload: str, sizes: tuple[int, ...], num_tokens: int, rounds: int):
    """Every batch size of one workload, the engines built once (as the script's sweep)."""
    return speculative.sweep(list(sizes), K, num_tokens, rounds, workload)


@pytest.mark.parametrize("mode", speculative.MODES)
def test_speculation(benchmark, request, mode, workload, batch):
    config = request.config
    timings = measured(workload, batches(config), tokens(config), repeats(config))[batch]
    if mode in speculative.EXACT:
        diff = first_difference(timings["plain"].outputs, timings[mode].outputs)
        assert diff is None, f"{mode} against plain: {diff}"
    t = timings[mode]
    extra = speculative.spec_summary(t)
    extra.update(batch=batch, workload=workload, k=K, equal_to_plain=True)
    record(benchmark, f"speculation-{workload}-b{batch}", t, "seconds", **extra)
