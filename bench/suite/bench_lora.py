"""LoRA (bench/lora.py): wall seconds for one batch with no adapter (base) against the same
batch with 1 and 8 distinct rank-8 adapters mixed (full run: batch 32 x 64 tokens, also 4 and 32
adapters and HF transformers + PEFT mixing 8; quick: batch 8 x 16 tokens). Every request of
every mode must equal HF + PEFT run on it alone with the same adapter (or none)."""

from __future__ import annotations

import functools

import pytest

from bench import lora
from bench.suite.common import quick, record, repeats

MODES = ["base", "lora1", "lora4", "lora8", "lora32", f"hf+peft{lora.HF_ADAPTERS}"]


def shape(config) -> tuple[int, int, tuple[int, ...], bool]:
    """(batch, tokens per request, adapter counts, HF timed too)."""
    if quick(config):
        return 8, 16, (1, 8), False
    return 32, 64, (1, 4, 8, 32), True


@functools.cache
def measured(batch: int, tokens: int, counts: tuple[int, ...], rounds: int, hf: bool):
    """Every mode alternated and the reference, once per process (the adapters are written to
    and removed from a temporary directory of this process inside the call)."""
    return lora.measure(batch, tokens, list(counts), rounds, hf)


@pytest.mark.parametrize("mode", MODES)
def test_lora(benchmark, request, mode):
    batch, tokens, counts, hf = shape(request.config)
    timings, expected = measured(batch, tokens, counts, repeats(request.config), hf)
    if mode not in timings:
        pytest.skip("full run only")
    bad = lora.mismatches(timings, expected)
    assert mode not in bad, f"{mode} against HF + PEFT alone: {bad[mode]}"
    seconds = timings[mode].median("seconds")
    extra = {
        "batch": batch,
        "tokens_per_request": tokens,
        "adapters": lora.mode_counts(list(counts), hf)[mode] or 0,
        "equal_to_reference": True,
        "tokens_per_s": round(batch * tokens / seconds, 2),
        "vs_base": round(timings["base"].median("seconds") / seconds, 4),
        "differ_from_base": lora.differ_from_base(timings, mode),
    }
    record(benchmark, f"lora-b{batch}", timings[mode], "seconds", **extra)
