"""Speculative decoding: batch-1 latency and batched throughput with and without speculation.

    python -m bench.speculative [--parts ngram,draft,sweep] [--max-tokens N] [--k K]
                                [--batches 1,4,16,64] [--repeats 3] [--sweep-tokens N]
                                [--workloads mixed,open]

One thread, greedy, EOS ignored (every request generates exactly its max_tokens), prefix caching
off in every engine. Parts:

- ngram: SmolLM2-135M-Instruct on input-grounded chat prompts (rewrite / extract / fix a text
  given in the prompt), prompt-lookup drafts, one request at a time (batch 1);
- draft: Qwen2.5-Coder-1.5B-Instruct target with the 0.5B as draft model, on code prompts
  (completion, and edit-style prompts that repeat their input), one request at a time;
- sweep: SmolLM2 with n-gram speculation at batch 1, 4, 16, 64 on distinct prompts, two
  workloads: "mixed" (half input-grounded, where drafts land, half open-ended, where they mostly
  do not) and "open" (open-ended only); the suite's speculation groups are these cells.

Each part runs three modes on the same prompts: plain (no speculation), fixed (k drafts every
step) and adaptive (the engine default: k per request and step from measured acceptance and step
costs, capped at k). Each mode is its own engine, except in the draft part, where three copies
of the 1.5B target would not fit in memory: there fixed and adaptive share one engine and fixed
runs with its adaptive planner taken out (what `adaptive_speculation=False` builds).

Fair by construction (bench/harness.py): every mode is warmed up once on the same prompts as
its timed runs (equal for all modes; with the prefix cache off nothing carries over to the timed
runs but the adaptive planner's step-cost fits, which an engine keeps for its life by design),
then --repeats rounds alternate the modes; figures are medians with their spread. fixed and
adaptive must equal plain token for token, else the script exits 1 (RESULT is printed anyway).

Per-token latency = median wall seconds / output tokens; sweep throughput = output tokens /
median wall seconds of the whole batch. Acceptance counters are summed over each mode's own
timed rounds. The RESULT speedups are adaptive's (median plain / median adaptive seconds);
worst_batch_slowdown = max(0, 1 - adaptive / plain throughput) over the sweep's batch sizes and
workloads; mean_accept_len = 1 + accepted drafts per verification step of the ngram part's
adaptive mode over its timed rounds ("na" without that part). Last line:
    RESULT spec_speedup_draft=.. spec_speedup_ngram=.. worst_batch_slowdown=.. mean_accept_len=..
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import time
from collections.abc import Callable

import torch

from bench.harness import Run, Timings, alternate, summary, unequal

SMOLLM = "smollm2-135m-instruct"
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
MODES = ("plain", "fixed", "adaptive")
EXACT = ["fixed", "adaptive"]  # must equal plain token for token

PASSAGE = (
    "The Tandem engine keeps its KV cache in fixed-size blocks. Each request owns a block table "
    "that maps its logical blocks to physical ones, blocks are allocated from a free pool on "
    "demand, and full blocks are hashed so that requests with a common prefix share them. When "
    "the pool runs out, the most recently admitted request is preempted and recomputed later."
)
GROUNDED = [
    f"Rewrite the following text in the first person plural, keeping every sentence:\n\n{PASSAGE}",
    f"Copy the following text, replacing the word 'blocks' with 'pages':\n\n{PASSAGE}",
    f"List every sentence of this text as a bullet point, word for word:\n\n{PASSAGE}",
]
OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Give me three ideas for a birthday party for a ten-year-old, with a sentence on each.",
    "Explain why the sky is blue to a curious child.",
]
CODE = [
    "def merge_sort(items):\n",
    "Add type hints to this function and return the whole function:\n\n"
    "def moving_average(values, window):\n    out = []\n    total = 0.0\n"
    "    for i, v in enumerate(values):\n        total += v\n        if i >= window:\n"
    "            total -= values[i - window]\n        if i >= window - 1:\n"
    "            out.append(total / window)\n    return out\n",
    "Rename the variable `total` to `running_sum` in this code and print the full result:\n\n"
    "def moving_average(values, window):\n    out = []\n    total = 0.0\n"
    "    for i, v in enumerate(values):\n        total += v\n        if i >= window:\n"
    "            total -= values[i - window]\n        if i >= window - 1:\n"
    "            out.append(total / window)\n    return out\n",
]


def chat_prompts(llm, texts: list[str]) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def spec_modes(spec_args: dict, k: int) -> dict[str, dict]:
    """Engine arguments per mode: no speculation, a fixed k, adaptive with k as the cap."""
    return {
        "plain": {},
        "fixed": {**spec_args, "num_speculative_tokens": k, "adaptive_speculation": False},
        "adaptive": {**spec_args, "num_speculative_tokens": k, "adaptive_speculation": True},
    }


def engines(model: str, spec_args: dict, k: int, share: bool, **engine_args) -> dict[str, tuple]:
    """(engine, adaptive planner to install before each run) per mode. share: fixed runs on
    adaptive's engine with the planner taken out (None), for targets too big to load thrice."""
    from engine import LLM

    modes = spec_modes(spec_args, k)
    if share:
        del modes["fixed"]
    common = dict(quantization=None, num_threads=1, enable_prefix_caching=False)
    llms = {mode: LLM(model, **common, **engine_args, **args) for mode, args in modes.items()}
    out = {mode: (llm, llm.engine.speculation.adaptive) for mode, llm in llms.items()}
    if share:
        out["fixed"] = (llms["adaptive"], None)
    return {mode: out[mode] for mode in MODES}


def counters(llm) -> tuple[int, int, int]:
    s = llm.engine.speculation.stats
    return s.num_steps, s.num_drafts, s.num_accepted


def engine_mode(llm, planner, prompts, params, one_at_a_time: bool) -> Callable[[], Run]:
    """One run: every prompt, one request at a time or all in one batch. Metrics: wall seconds,
    and this run's own verification steps, drafts and accepted drafts (counter deltas)."""

    def run() -> Run:
        llm.engine.speculation.adaptive = planner
        before = counters(llm)
        t0 = time.perf_counter()
        if one_at_a_time:
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        steps, drafts, accepted = (b - a for a, b in zip(before, counters(llm), strict=True))
        ids = [o.outputs[0].token_ids for o in outs]
        metrics = {"seconds": seconds, "steps": steps, "drafts": drafts, "accepted": accepted}
        return Run(metrics, ids, {"tokens": sum(map(len, ids)), "requests": len(ids)})

    return run


def spec_summary(t: Timings) -> dict:
    """Throughput at the median time, and acceptance over this mode's own timed rounds:
    acceptance = accepted / drafted; accepted_per_step = accepted drafts per verification step
    (mean_accept_len adds the bonus token each step emits); drafted = share of decode
    request-steps that carried drafts (each request-step emits 1 + its accepted drafts)."""
    tokens = t.info["tokens"]
    steps, drafts, accepted = (sum(t.values(m)) for m in ("steps", "drafts", "accepted"))
    request_steps = tokens * len(t.runs) - accepted
    return {
        "tokens_per_s": round(tokens / t.median("seconds"), 2),
        "acceptance": round(accepted / drafts, 4) if drafts else 0.0,
        "accepted_per_step": round(accepted / steps, 4) if steps else 0.0,
        "mean_accept_len": round(1 + accepted / steps, 4) if steps else 1.0,
        "drafted": round(steps / request_steps, 4) if request_steps else 0.0,
    }


def latency_part(model, texts, tokens, spec_args, k, repeats, share=False) -> dict[str, Timings]:
    """Batch-1 latency: each mode runs the prompts one request at a time."""
    from engine import SamplingParams

    torch.set_flush_denormal(True)
    built = engines(model, spec_args, k, share, kv_cache_memory_bytes=512 << 20)
    prompts = chat_prompts(built["plain"][0], texts)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    modes = {m: engine_mode(llm, p, prompts, params, True) for m, (llm, p) in built.items()}
    return alternate(modes, repeats, threads=1)


def sweep_prompts(llm, n: int, workload: str) -> list[list[int]]:
    """n distinct chat prompts: "mixed" alternates input-grounded tasks (drafts land) and
    open-ended ones (prompt lookup finds little, and what it proposes is mostly rejected);
    "open" has only the latter."""
    texts = []
    for i in range(n):
        if workload == "mixed":
            task = (GROUNDED if i % 2 == 0 else OPEN)[(i // 2) % 3]
        else:
            task = OPEN[i % 3]
        texts.append(f"Request {i}. {task}")
    return chat_prompts(llm, texts)


def sweep(batches, k, tokens, repeats, workload) -> dict[int, dict[str, Timings]]:
    """Each batch size's modes alternated on `batch` distinct prompts run together: n-gram on
    SmolLM2, the engines built once for all batch sizes."""
    from engine import SamplingParams

    torch.set_flush_denormal(True)
    # KV for the largest batch: 16 MiB a request holds ~350 tokens of SmolLM2 (46 KiB each), a
    # prompt (<= 150 tokens), the output and the k lookahead slots.
    kv = (64 << 20) + max(batches) * (16 << 20)
    built = engines(SMOLLM, {"speculative_method": "ngram"}, k, False, kv_cache_memory_bytes=kv)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    results = {}
    for b in batches:
        prompts = sweep_prompts(built["plain"][0], b, workload)
        modes = {m: engine_mode(llm, p, prompts, params, False) for m, (llm, p) in built.items()}
        results[b] = alternate(modes, repeats, threads=1)
    return results


def mismatches(timings: dict[str, Timings], label: str) -> bool:
    """Print every mode whose tokens differ from plain's; True when any does."""
    found = unequal(timings, "plain", EXACT)
    for mode, where in found.items():
        print(f"MISMATCH [{label}] {mode} against plain: {where}", flush=True)
    return bool(found)


def speedup(timings: dict[str, Timings], mode: str) -> float:
    """Median plain seconds / median mode seconds (> 1: the mode is faster; same tokens)."""
    return timings["plain"].median("seconds") / timings[mode].median("seconds")


def report(label: str, timings: dict[str, Timings]) -> None:
    print(f"-- {label}: wall seconds per run (median of {len(timings['plain'].runs)} rounds)")
    print(summary(timings, "seconds"))
    tokens = timings["plain"].info["tokens"]
    for mode in MODES:
        s = spec_summary(timings[mode])
        per_token = 1e3 * timings[mode].median("seconds") / tokens
        print(
            f"[{label}/{mode}] {per_token:.1f} ms/token, {s['tokens_per_s']:.1f} tokens/s, "
            f"{speedup(timings, mode):.2f}x plain; acceptance {s['acceptance']:.2f}, mean "
            f"accepted length {s['mean_accept_len']:.2f}, {s['drafted']:.0%} of request-steps "
            "drafted",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="ngram,draft,sweep")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per request, batch 1")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds per part")
    ap.add_argument("--sweep-tokens", type=int, default=64, help="tokens per request, sweep")
    ap.add_argument("--workloads", default="mixed,open", help="sweep workloads")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    parts = set(args.parts.split(","))
    out = {"draft": "na", "ngram": "na", "slow": "na", "mal": "na"}
    failed = False
    if "ngram" in parts:
        spec = {"speculative_method": "ngram"}
        t = latency_part(SMOLLM, GROUNDED, args.max_tokens, spec, args.k, args.repeats)
        report("ngram", t)
        failed |= mismatches(t, "ngram")
        out["ngram"] = f"{speedup(t, 'adaptive'):.3f}"
        out["mal"] = f"{spec_summary(t['adaptive'])['mean_accept_len']:.3f}"
    if "draft" in parts:
        spec = {"draft_model": DRAFT}
        t = latency_part(TARGET, CODE, args.max_tokens, spec, args.k, args.repeats, share=True)
        report("draft", t)
        failed |= mismatches(t, "draft")
        out["draft"] = f"{speedup(t, 'adaptive'):.3f}"
    if "sweep" in parts:
        batches = [int(b) for b in args.batches.split(",")]
        worst = float("inf")
        for workload in args.workloads.split(","):
            cells = sweep(batches, args.k, args.sweep_tokens, args.repeats, workload)
            for b, t in cells.items():
                report(f"sweep/{workload}/batch {b}", t)
                failed |= mismatches(t, f"sweep/{workload}/batch {b}")
                worst = min(worst, speedup(t, "adaptive"))
        out["slow"] = f"{max(0.0, 1.0 - worst):.3f}"
    print(
        f"RESULT spec_speedup_draft={out['draft']} spec_speedup_ngram={out['ngram']} "
        f"worst_batch_slowdown={out['slow']} mean_accept_len={out['mal']}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
