"""Grammar-constrained decoding (bench/grammar.py): JSON-schema requests on SmolLM2, wall seconds
per batch, unconstrained against constrained (xgrammar masks only), constrained with
grammar-forced tokens as free drafts, and forced tokens plus n-gram drafts. forced and
forced+ngram must equal constrained token for token; unconstrained generates exactly as many
tokens per request as constrained (EOS ignored). Quick: batch 1, two requests one at a time,
at most 64 tokens each; full: batch 1 (four requests one at a time) and batch 16
(sixteen together), 160 tokens at most. Groups: grammar-b<batch>."""

from __future__ import annotations

import functools

import pytest

from bench import grammar
from bench.suite.common import quick, record, repeats


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "batch" in metafunc.fixturenames:
        sizes = batches(metafunc.config)
        metafunc.parametrize("batch", sizes, ids=lambda n: f"b{n}", scope="module")


def batches(config) -> tuple[int, ...]:
    return (1,) if quick(config) else (1, 16)


@functools.cache
def measured(sizes: tuple[int, ...], max_tokens: int, rounds: int, num_requests: int | None):
    """Every batch size, the engines built once (as the script does); no HF mode."""
    return grammar.measure(list(sizes), max_tokens, rounds, num_requests)


@pytest.mark.parametrize("mode", grammar.MODES)
def test_grammar(benchmark, request, mode, batch):
    config = request.config
    fast = quick(config)
    every = measured(batches(config), 64 if fast else 160, repeats(config), 2 if fast else None)
    timings = every[batch]
    broken = grammar.problems(timings)
    assert mode not in broken, f"{mode}: {broken[mode]}"
    t = timings[mode]
    extra = grammar.grammar_summary(t)
    extra["batch"] = batch
    if mode in grammar.EXACT:
        extra["equal_to_constrained"] = True
    elif mode == "unconstrained":
        extra["token_counts_equal"] = True
    record(benchmark, f"grammar-b{batch}", t, "seconds", **extra)
