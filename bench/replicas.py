"""Data-parallel replicas on this machine: one engine against two Ray Serve replicas, routed in
turn or by cached prefix, on a shared-system-prompt workload.

    python -m bench.replicas [--model smollm2-135m-instruct] [--systems 3] [--system-len 512]
                             [--rounds 6] [--tokens 16] [--concurrency 4] [--repeats 3]

Work (one run): --systems system prompts of --system-len tokens (real English text), each asked
--rounds questions of 16 tokens of its own, --concurrency requests in flight at a time, greedy,
--tokens new tokens each, EOS ignored; prefix caching on (it is the subject). Every run uses a
fresh set of system prompts (the nth run of every mode the same set), so each starts with none
of its prefixes cached. KV budget: --blocks in total per mode, split evenly over replicas, so
that one replica holds about half the system prompts: routing decides what stays cached.
Modes, alternated (bench/harness.py: a warm-up each, then --repeats rounds, median and spread):
- engine-t2: one engine in this process (AsyncEngine, no Ray) on 2 threads;
- 1x-t2: the same engine as one Ray Serve replica (the cost of the Ray hop);
- 2x-rr: two replicas of 1 thread each, round-robin; 2x-prefix: the same, prefix-aware routing.
Per run: output tokens per second over the wall time, median time to first token, and the
prefix-cache hit rate (hit / looked-up prompt tokens, from the engines' counters).
Every mode's tokens must equal engine-t2's (exit 1 otherwise).
Last line: RESULT prefix_x_rr_tokens_per_s=.. prefix_hit_rate=.. rr_hit_rate=..
2x_x_1x_tokens_per_s=..
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import asyncio
import itertools
import statistics
import time
from collections.abc import Callable

from bench.harness import Run, Timings, alternate, summary, unequal
from bench.quality import held_tokens

MODEL = "smollm2-135m-instruct"
MODES = ("engine-t2", "1x-t2", "2x-rr", "2x-prefix")


def config(model: str, threads: int, blocks: int, max_len: int):
    from engine.config import EngineConfig

    return EngineConfig(
        model=model,
        quantization=None,
        num_threads=threads,
        num_kv_blocks=blocks,
        max_model_len=max_len,
    )


class Workload:
    """The nth call gives the nth set of (system prompt + question) prompts."""

    def __init__(self, tokenizer, systems: int, system_len: int, rounds: int, runs: int):
        self.systems, self.system_len, self.rounds = systems, system_len, rounds
        per_run = systems * system_len + systems * rounds * 16
        self.text = held_tokens(tokenizer, per_run * runs)

    def prompts(self, run: int) -> list[list[int]]:
        base = run * (self.systems * self.system_len + self.systems * self.rounds * 16)
        at = itertools.count(base + self.systems * self.system_len, 16)
        systems = [
            self.text[base + s * self.system_len : base + (s + 1) * self.system_len]
            for s in range(self.systems)
        ]
        out = []
        for _ in range(self.rounds):  # every system prompt in turn, each time a new question
            for system in systems:
                start = next(at)
                out.append(system + self.text[start : start + 16])
        return out


def hit_tokens(summaries: list[dict]) -> tuple[int, int]:
    return (
        sum(s["prefix_cache"]["hit_tokens"] for s in summaries),
        sum(s["prefix_cache"]["query_tokens"] for s in summaries),
    )


def serving_mode(
    engine, summaries: Callable[[], list[dict]], workload: Workload, tokens: int, concurrency: int
) -> Callable[[], Run]:
    """A run: every prompt of the next set through `engine` (an AsyncEngine or Replicas),
    at most `concurrency` at a time."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    runs = itertools.count()

    async def one(i: int, prompt: list[int], gate: asyncio.Semaphore, t0: float):
        async with gate:
            stream = await engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
            first, ids = None, []
            async for out in stream:
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                ids += out.outputs[0].token_ids
            return first, ids

    async def all_of(prompts: list[list[int]]):
        gate = asyncio.Semaphore(concurrency)
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(i, p, gate, t0) for i, p in enumerate(prompts)))
        return time.perf_counter() - t0, done

    def run() -> Run:
        prompts = workload.prompts(next(runs))
        hits0, queries0 = hit_tokens(summaries())
        seconds, done = asyncio.run(all_of(prompts))
        hits, queries = hit_tokens(summaries())
        ids = [d[1] for d in done]
        metrics = {
            "tokens_per_s": sum(map(len, ids)) / seconds,
            "ttft": statistics.median(d[0] for d in done),
            "hit_rate": (hits - hits0) / max(1, queries - queries0),
        }
        return Run(metrics, ids, {"seconds": seconds})

    return run


def settled(replicas, period: float) -> Callable[[], list[dict]]:
    """The replicas' engine summaries (read live), after waiting for the router's view of
    them to be current too (their reports come every `period`)."""

    def read() -> list[dict]:
        time.sleep(3 * period)
        return list(replicas.summaries().values())

    return read


def measure(args) -> dict[str, Timings]:
    from engine.entrypoints.async_engine import AsyncEngine
    from engine.entrypoints.replicas import ROUTING_STATS_PERIOD_S, Replicas
    from engine.llm_engine import LLMEngine

    max_len = args.system_len + 16 + args.tokens + 16
    single = config(args.model, 2, args.blocks, max_len)
    half = config(args.model, 1, args.blocks // 2, max_len)
    local = AsyncEngine(LLMEngine(single))
    deployments = {
        "1x-t2": Replicas.start(single, 1, app="one"),
        "2x-rr": Replicas.start(half, 2, policy="round_robin", app="round-robin"),
        "2x-prefix": Replicas.start(half, 2, policy="prefix", app="prefix"),
    }
    runs = 1 + args.repeats  # the warm-up, then the rounds
    workload = Workload(local.engine.tokenizer, args.systems, args.system_len, args.rounds, runs)
    modes = {
        "engine-t2": serving_mode(
            local, lambda: [local.summary()], workload, args.tokens, args.concurrency
        )
    }
    for name, replicas in deployments.items():
        reads = settled(replicas, ROUTING_STATS_PERIOD_S)
        modes[name] = serving_mode(replicas, reads, workload, args.tokens, args.concurrency)
    try:
        return alternate(modes, args.repeats)
    finally:
        local.shutdown()
        for replicas in deployments.values():
            replicas.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--systems", type=int, default=3)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=160, help="KV blocks per mode, all replicas")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    timings = measure(args)
    n = args.systems * args.rounds
    print(
        f"{n} requests: {args.systems} system prompts of {args.system_len} tokens, "
        f"{args.tokens} new tokens each, {args.concurrency} in flight; output tokens/s"
    )
    print(summary(timings, "tokens_per_s", 1, "tok/s"))
    print("median time to first token")
    print(summary(timings, "ttft", 1e3, "ms"))
    print("prefix-cache hit rate")
    print(summary(timings, "hit_rate", 1, ""))
    bad = unequal(timings, "engine-t2", [m for m in MODES if m != "engine-t2"])
    for name, where in bad.items():
        print(f"MISMATCH {name}: {where}")
    speed = {m: timings[m].median("tokens_per_s") for m in MODES}
    print(
        f"RESULT prefix_x_rr_tokens_per_s={speed['2x-prefix'] / speed['2x-rr']:.2f} "
        f"prefix_hit_rate={timings['2x-prefix'].median('hit_rate'):.3f} "
        f"rr_hit_rate={timings['2x-rr'].median('hit_rate'):.3f} "
        f"2x_x_1x_tokens_per_s={speed['2x-prefix'] / speed['1x-t2']:.2f}"
    )
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
