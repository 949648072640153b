"""Batch-1 latency (bench/decode.py): time to first token and time per output token at prompt
lengths 64 / 512 / 2048 on 1 and 2 threads: the engine in its precisions and with each
speculation method, HF transformers at its fastest measured setting, llama.cpp on the same GGUF
when its binaries are given. Also (full run) HF's settings against each other, which is how
HF_FASTEST was chosen."""

from __future__ import annotations

import functools

import pytest

from bench import decode, hf_baselines
from bench.harness import first_difference
from bench.suite.common import quick, record, repeats

MODES = [*decode.ENGINES, "hf", "llama.cpp"]
HF_SETTINGS = {
    "eager": ("eager", None),
    "sdpa": ("sdpa", None),
    "eager+static": ("eager", "static"),
    "sdpa+static": ("sdpa", "static"),
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    fast = quick(metafunc.config)
    if "prompt_len" in metafunc.fixturenames:
        lengths = [64, 512] if fast else [64, 512, 2048]
        metafunc.parametrize("prompt_len", lengths, ids=lambda n: f"p{n}", scope="module")
    if "threads" in metafunc.fixturenames:
        metafunc.parametrize("threads", [1, 2], ids=lambda n: f"t{n}", scope="module")


@functools.cache
def measured(prompt_len: int, threads: int, tokens: int, rounds: int, llama_cpp: str | None):
    bin_dir = decode.llama_cpp_dir(llama_cpp)
    return decode.measure(prompt_len, threads, tokens, rounds, bin_dir)


@functools.cache
def quality(threads: int):
    return decode.quality_report(threads)


def tokens(config) -> int:
    return 32 if quick(config) else 64


@pytest.mark.parametrize("metric", ["ttft", "per_token"])
@pytest.mark.parametrize("mode", MODES)
def test_decode(benchmark, request, mode, metric, prompt_len, threads):
    config = request.config
    timings = measured(
        prompt_len, threads, tokens(config), repeats(config), config.getoption("llama_cpp")
    )
    if mode not in timings:
        pytest.skip("no llama.cpp binaries (--llama-cpp DIR or TANDEM_LLAMA_CPP)")
    extra = {"prompt_tokens": prompt_len, "threads": threads}
    if mode in decode.EXACT:
        diff = first_difference(timings["fp32"].outputs, timings[mode].outputs)
        assert diff is None, f"{mode} against fp32: {diff}"
        extra["equal_to_fp32"] = True
    elif mode == "gguf":
        report = quality(threads)
        assert report.passes, f"gguf fails the quality rule against fp32: {report}"
        extra.update(perplexity_ratio=round(report.perplexity_ratio, 4))
        extra.update(top1_agreement=round(report.top1_agreement, 4))
    record(benchmark, f"decode-{metric}-p{prompt_len}-t{threads}", timings[mode], metric, **extra)


@functools.cache
def hf_settings_measured(threads: int, rounds: int):
    return decode.measure(512, threads, 32, rounds, hf_settings=HF_SETTINGS, engines=[])


@pytest.mark.parametrize("setting", HF_SETTINGS)
def test_hf_settings(benchmark, request, setting):
    """HF's attention implementations and caches on the same 512-token prompt, 32 new tokens,
    1 thread, whole `generate` seconds (a static cache can win per token and lose at the first).
    The one the benchmarks use (bench/hf_baselines.py's HF_FASTEST) must not be beaten by another
    by more than the two settings' spreads."""
    if quick(request.config):
        pytest.skip("full run only")
    timings = hf_settings_measured(1, repeats(request.config))
    fastest = tuple(hf_baselines.HF_FASTEST.values())
    used = next(k for k, v in HF_SETTINGS.items() if v == fastest)
    for name, t in timings.items():
        assert t.outputs == timings[used].outputs, f"HF {name} and {used} differ"
    ours, theirs = timings[used], timings[setting]
    margin = ours.spread("seconds") + theirs.spread("seconds")
    assert theirs.median("seconds") + margin >= ours.median("seconds"), (
        f"HF {setting} is faster than HF_FASTEST ({used}): update bench/hf_baselines.py"
    )
    extra = {f"{m}_ms": round(theirs.median(m) * 1e3, 2) for m in ("ttft", "per_token")}
    record(benchmark, "hf-settings-seconds-p512-t1", theirs, "seconds", **extra)
