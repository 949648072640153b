"""llama.cpp batched (bench/peers.py): 24 requests x (75 prompt + 38 new tokens) submitted at
once, the engine on the GGUF's own blocks against `llama-batched-bench` on the same file, wall
seconds, 1 and 2 threads, full run only (skipped without llama.cpp's binaries: --llama-cpp DIR or
TANDEM_LLAMA_CPP). llama.cpp's tokens are not visible; the engine's batch must give every request
the tokens it gets alone. Groups: llama.cpp-batch-t{1,2}."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from bench import peers
from bench.harness import first_difference
from bench.suite.common import quick, record, repeats


@functools.cache
def measured(threads: int, rounds: int, bin_dir: Path):
    from engine.models.loader import gguf_file
    from engine.models.registry import resolve_model

    gguf = gguf_file(resolve_model(peers.MODEL, dense=False))
    return peers.batch_measure(threads, rounds, bin_dir, gguf)


@pytest.mark.parametrize("threads", [1, 2], ids=lambda n: f"t{n}")
@pytest.mark.parametrize("mode", ["engine", "llama.cpp"])
def test_llama_cpp_batch(benchmark, request, mode, threads):
    config = request.config
    if quick(config):
        pytest.skip("full run only")
    bin_dir = peers.llama_cpp_dir(config.getoption("llama_cpp"))  # or TANDEM_LLAMA_CPP
    if bin_dir is None:
        pytest.skip("no llama.cpp binaries (--llama-cpp DIR or TANDEM_LLAMA_CPP)")
    timings, alone = measured(threads, repeats(config), bin_dir)
    diff = first_difference(alone, timings["engine"].outputs)
    assert diff is None, f"the engine's batch against each request alone: {diff}"
    extra = {"threads": threads, "requests": 24, "engine_rows_equal_alone": True}
    record(benchmark, f"llama.cpp-batch-t{threads}", timings[mode], "seconds", **extra)
