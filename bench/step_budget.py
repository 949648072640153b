"""Tail latency under load with and without the step-time budget (`max_step_ms`).

    python -m bench.step_budget [--clients 16] [--requests 48] [--budgets 50,100,200]
        [--threads 2] [--repeats 2] [--model smollm2-135m-instruct]

A closed loop in one engine (no HTTP, so the scheduling alone is measured): `--clients` streams,
each sending its next request as soon as its last one ends, until `--requests` are done. Every
request: a real English prompt of 150-650 tokens (CPython's documentation text, bench/quality.py,
at a seeded offset and length, mean ~400 as in the serving issue's workload), 64 new tokens,
greedy, EOS ignored; prefix caching off; the default path (the GGUF's blocks). Per mode:
inter-token latency p50 / p95 / p99 over every gap between a request's consecutive tokens,
TTFT p50 / p95 (from the request's submission), output tokens/s over the run. Modes (budget
off, then each budget) alternate (bench/harness.py), median of --repeats. The modes' token ids
must be equal (the budget only moves chunk boundaries): exit 1 otherwise.
Last line: RESULT off_itl_p95_ms=.. b<MS>_itl_p95_ms=.. ... (and tok/s per mode).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from bench.harness import Run, alternate, unequal

NEW_TOKENS = 64


def workload(tokenizer, count: int, seed: int) -> list[list[int]]:
    from bench.quality import held_text

    ids = tokenizer(held_text(), add_special_tokens=False).input_ids
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(150, 650)
        start = rng.randint(0, len(ids) - n)
        out.append(ids[start : start + n])
    return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def closed_loop(engine, prompts: list[list[int]], clients: int) -> Run:
    from engine import SamplingParams

    params = SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, output_kind="delta"
    )
    queue = list(enumerate(prompts))
    sent, stamps, tokens = {}, {}, {}

    def send() -> None:
        i, prompt = queue.pop(0)
        rid = str(i)
        engine.add_request(rid, prompt, params)
        sent[rid], stamps[rid], tokens[rid] = time.perf_counter(), [], []

    for _ in range(min(clients, len(queue))):
        send()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            new = out.outputs[0].token_ids
            stamps[out.request_id] += [now] * len(new)
            tokens[out.request_id] += new
            if out.finished and queue:
                send()
    seconds = time.perf_counter() - start
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:], strict=False)]
    ttft = [stamps[r][0] - sent[r] for r in stamps]
    metrics = {
        "itl_p50": statistics.median(gaps),
        "itl_p95": percentile(gaps, 0.95),
        "itl_p99": percentile(gaps, 0.99),
        "ttft_p50": statistics.median(ttft),
        "ttft_p95": percentile(ttft, 0.95),
        "tok_s": sum(len(t) for t in tokens.values()) / seconds,
    }
    return Run(metrics, [tokens[str(i)] for i in range(len(prompts))])


def main(argv: list[str] | None = None) -> int:
    from engine import LLMEngine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--budgets", default="50,100,200", help="max_step_ms values, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    budgets = [None, *(float(b) for b in args.budgets.split(","))]
    engines = {
        ("off" if b is None else f"b{b:g}"): LLMEngine(
            model=args.model,
            max_step_ms=b,
            enable_prefix_caching=False,
            num_threads=args.threads,
            max_num_seqs=args.clients,
        )
        for b in budgets
    }
    prompts = workload(engines["off"].tokenizer, args.requests, args.seed)
    print(f"{args.model}: {args.clients} clients, {args.requests} requests of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} prompt tokens "
          f"(mean {statistics.mean(map(len, prompts)):.0f}) + {NEW_TOKENS}, "
          f"{args.threads} threads")  # fmt: skip
    modes = {
        name: (lambda e=e: closed_loop(e, prompts, args.clients)) for name, e in engines.items()
    }
    timings = alternate(modes, args.repeats, threads=args.threads)
    result = {}
    for name, t in timings.items():
        med = {k: t.median(k) for k in t.runs[0].metrics}
        print(f"{name:5s} inter-token p50 {med['itl_p50'] * 1e3:7.1f} ms  p95 "
              f"{med['itl_p95'] * 1e3:7.1f}  p99 {med['itl_p99'] * 1e3:7.1f}  TTFT p50 "
              f"{med['ttft_p50'] * 1e3:7.0f} ms  p95 {med['ttft_p95'] * 1e3:7.0f}  "
              f"{med['tok_s']:6.1f} tok/s (spread {t.spread('tok_s'):.1f})")  # fmt: skip
        result[f"{name}_itl_p95_ms"] = med["itl_p95"] * 1e3
        result[f"{name}_tok_s"] = med["tok_s"]
    bad = unequal(timings, "off", [n for n in timings if n != "off"])
    for name, where in bad.items():
        print(f"OUTPUTS DIFFER: {name}: {where}")
    print("RESULT " + " ".join(f"{k}={v:.1f}" for k, v in result.items())
          + f" outputs_equal={not bad}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
