"""The throughput benchmarks' workload, and what one pass over it measured."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from bench.harness import Run

MODEL = "smollm2-135m-instruct"


@dataclass
class Workload:
    prompts: list[list[int]]
    out_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.out_lens)


def workload_run(seconds: float, outputs: list[list[int]], **info) -> Run:
    """One pass over a workload as a harness Run: wall seconds and output tokens per second (the
    useful tokens only: each request's own output length), outputs in request order."""
    tokens = sum(len(ids) for ids in outputs)
    metrics = {"seconds": seconds, "tok_s": tokens / seconds}
    return Run(metrics, outputs, {"requests": len(outputs), "output_tokens": tokens, **info})


@dataclass
class ModeResult:
    name: str
    seconds: float | None = None  # wall seconds for the timed requests
    num_requests: int = 0  # requests actually timed
    output_tokens: int = 0  # useful generated tokens in those requests
    prompt_tokens: int = 0
    outputs: dict[int, list[int]] = field(default_factory=dict)  # request index -> token ids
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    extrapolated: bool = False  # timed a subset; tokens/s stands for the whole workload

    def tally(self, wl: Workload) -> None:
        """Count the timed requests and their tokens from the outputs recorded."""
        self.num_requests = len(self.outputs)
        self.output_tokens = sum(len(t) for t in self.outputs.values())
        self.prompt_tokens = sum(len(wl.prompts[i]) for i in self.outputs)

    @property
    def ok(self) -> bool:
        return self.error is None and self.seconds is not None and self.seconds > 0

    @property
    def out_tok_s(self) -> float | None:
        return self.output_tokens / self.seconds if self.ok else None

    @property
    def total_tok_s(self) -> float | None:
        return (self.output_tokens + self.prompt_tokens) / self.seconds if self.ok else None


# ---- workload ----------------------------------------------------------------------------


def _lognormal_lengths(
    rng: random.Random, n: int, median: float, sigma: float, lo: int, hi: int
) -> list[int]:
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def make_workload(
    n: int,
    seed: int,
    vocab_size: int,
    prompt: tuple[float, float, int, int],
    output: tuple[float, float, int, int],
) -> Workload:
    """`prompt`/`output`: (median, sigma, min, max) of a clipped lognormal length distribution."""
    rng = random.Random(seed)
    p_lens = _lognormal_lengths(rng, n, *prompt)
    o_lens = _lognormal_lengths(rng, n, *output)
    prompts = [[rng.randrange(100, vocab_size - 100) for _ in range(L)] for L in p_lens]
    return Workload(prompts, o_lens)
