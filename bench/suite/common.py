"""What every group of the suite shares: the options, and recording alternated timings.

Each group measures all its modes in one alternated run (bench/harness.py), cached per process,
and each benchmark test then records its own mode's runs into pytest-benchmark. pytest-benchmark
times a function's rounds back to back, one benchmark after another, which cannot alternate
modes; so the durations measured by the group are handed to the fixture's stats object, exactly
what `benchmark.pedantic` does with each round it times (`_make_stats` then `stats.update`,
pytest-benchmark 5.3). Everything downstream (the table, --benchmark-autosave, comparisons,
histograms) then works on our rounds. Outputs are checked before anything is recorded: a mode
whose tokens differ from its reference fails its test and records nothing.
"""

from __future__ import annotations

import statistics

import pytest

from bench.harness import Timings


def quick(config: pytest.Config) -> bool:
    return bool(config.getoption("quick"))


def repeats(config: pytest.Config) -> int:
    return int(config.getoption("repeats"))


def record(benchmark, group: str, timings: Timings, metric: str, **extra) -> None:
    """Hand `timings`' values of `metric` (seconds) to pytest-benchmark as its rounds."""
    benchmark.group = group
    benchmark._mode = "alternated rounds"  # the fixture was used (else pytest-benchmark warns)
    info = {k: v for k, v in timings.info.items() if not isinstance(v, list)}  # the last run's
    load = round(statistics.median(timings.loads), 2)
    benchmark.extra_info.update({**info, "metric": metric, "load_average": load, **extra})
    stats = benchmark._make_stats(1)  # one iteration per round, as pedantic(rounds=n) records
    for value in timings.values(metric):
        stats.update(value)
