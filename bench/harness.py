"""Timing alternatives fairly, shared by the `python -m bench.<name>` scripts and the
pytest-benchmark suite (bench/suite).

A *mode* is a callable that does one unit of work (a batch, a request) and returns a `Run`: the
quantities it measured (seconds, or seconds per token) and the token ids it produced. `alternate`
warms every mode up alike, then runs `repeats` rounds in which every mode runs once, the order
reversed every other round (A B C, C B A, ...) so that no mode always follows the same one or
always runs first on a machine whose speed drifts. Each mode's figure is the median over the
rounds with its spread (max - min), never only the best.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Run:
    """One timed run of one mode."""

    metrics: dict[str, float]  # e.g. {"seconds": 1.2} or {"ttft": 0.05, "per_token": 0.01}
    outputs: list[list[int]] | None = None  # token ids per request, to check modes equal
    info: dict = field(default_factory=dict)  # counters worth keeping (acceptance, tokens)


@dataclass
class Timings:
    """Every timed run of one mode."""

    name: str
    runs: list[Run] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)  # 1-minute load average before each run

    def values(self, metric: str) -> list[float]:
        return [run.metrics[metric] for run in self.runs]

    def median(self, metric: str) -> float:
        return statistics.median(self.values(metric))

    def spread(self, metric: str) -> float:
        values = self.values(metric)
        return max(values) - min(values)

    @property
    def outputs(self) -> list[list[int]] | None:
        """The last run's outputs (every run of a deterministic mode gives the same)."""
        return self.runs[-1].outputs

    @property
    def info(self) -> dict:
        return self.runs[-1].info


def load_average() -> float:
    return os.getloadavg()[0]


def alternate(
    modes: dict[str, Callable[[], Run]], repeats: int, warmup: int = 1, threads: int | None = None
) -> dict[str, Timings]:
    """Warm every mode up `warmup` times, then `repeats` alternating rounds (see the module doc).
    `threads`: torch's intra-op thread count, set before every run (an engine sets it only when
    it is built, and modes may live in engines built with other counts)."""
    names = list(modes)
    timings = {name: Timings(name) for name in names}

    def run(name: str) -> Run:
        if threads is not None:
            torch.set_num_threads(threads)
        return modes[name]()

    for _ in range(warmup):
        for name in names:
            run(name)
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else reversed(names):
            timings[name].loads.append(load_average())
            timings[name].runs.append(run(name))
    return timings


def first_difference(a: list[list[int]], b: list[list[int]]) -> str | None:
    """None when both modes produced the same token ids, else where they first differ."""
    if len(a) != len(b):
        return f"{len(a)} outputs against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            pairs = enumerate(zip(x, y, strict=False))
            at = next((j for j, (s, t) in pairs if s != t), min(len(x), len(y)))
            return f"request {i} differs at token {at} (lengths {len(x)} and {len(y)})"
    return None


def unequal(timings: dict[str, Timings], reference: str, others: list[str]) -> dict[str, str]:
    """Modes among `others` whose outputs differ from `reference`'s, with where."""
    want = timings[reference].outputs
    found = {}
    for name in others:
        diff = first_difference(want, timings[name].outputs)
        if diff:
            found[name] = diff
    return found


def summary(timings: dict[str, Timings], metric: str, unit: float = 1.0, label: str = "s") -> str:
    """One line per mode: median, spread and the runs' median load."""
    lines = []
    for name, t in timings.items():
        load = statistics.median(t.loads) if t.loads else float("nan")
        lines.append(
            f"{name:28s} {t.median(metric) * unit:9.3f} {label} "
            f"(spread {t.spread(metric) * unit:.3f}, load {load:.2f})"
        )
    return "\n".join(lines)
