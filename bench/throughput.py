"""Offline throughput: the Tandem engine against HF transformers on a ShareGPT-like workload.

    python -m bench.throughput [--quick | --size small|quick|full] [--num-requests N] [--seed S]
                               [--threads 1,2] [--repeats 3] [--modes tandem,hf_static,hf_cb]
    tandem bench throughput [--quick]

N requests of random token-id prompts with lognormal prompt/output lengths, greedy decoding,
EOS ignored (every request generates exactly its own output length), prefix caching off on
both sides. Modes, alternated (bench/harness.py: a warm-up pass each, then --repeats rounds,
median and spread), each pass the whole workload:

- tandem: `LLMEngine` driven with add_request/step, all requests submitted at once; the KV
  utilization (tokens stored / slots allocated) is sampled after every step via `snapshot()`
  (its cost measured and excluded).
- hf_static: `model.generate` on static batches in arrival order, left padded; every batch runs
  to its longest output and each request keeps only its own length (only useful tokens count).
- hf_cb: transformers' continuous batching (paged KV), one request per output length.
- hf_seq (only when asked for in --modes): `model.generate` one request at a time; with
  --hf-seq-limit K only the first K requests (its tok/s stands for the whole workload).
HF runs at its fastest measured setting (HF_FASTEST in bench/hf_baselines.py).

Time: wall seconds for the whole workload (model loading, cache allocation excluded);
throughput: output tokens / those seconds. Every HF mode's token ids must equal tandem's on
every request (exit 1 otherwise; the script prints each divergence with HF's top-2 logit margin
there, to tell an fp32 near-tie from a bug). Last line (ratios of median tok/s at the first
thread count, > 1 when tandem is faster; na for a mode not run):
    RESULT throughput_x_hf_seq=.. throughput_x_hf_static=.. throughput_x_hf_cb=.. kv_utilization=..
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:  # one thread, set before torch is imported when we can
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import gc
import time
from collections.abc import Callable

import torch

from bench.harness import Run, Timings, alternate, summary
from bench.hf_baselines import ContinuousBatching, hf_seq_mode, hf_static_mode, load_hf_model
from bench.workload import MODEL, Workload, make_workload, workload_run

HF_MODES = ["hf_seq", "hf_static", "hf_cb"]
# name -> (requests, prompt lengths, output lengths, static batch size); lengths are the
# (median, sigma, min, max) of a clipped lognormal. small: the suite's quick subset.
SIZES = {
    "small": (16, (24, 0.5, 8, 64), (12, 0.5, 4, 24), 16),
    "quick": (24, (64, 0.7, 16, 256), (28, 0.7, 8, 80), 16),
    "full": (64, (100, 0.8, 16, 512), (80, 0.8, 8, 256), 32),
}


def build_workload(size: str, num_requests: int | None = None, seed: int = 0) -> Workload:
    from engine.models.registry import resolve_model

    n, prompt_dist, output_dist, _ = SIZES[size]
    return make_workload(
        num_requests or n, seed, _vocab_size(resolve_model(MODEL)), prompt_dist, output_dist
    )


def describe(wl: Workload, size: str, seed: int) -> str:
    lines = [f"# workload {size}: {len(wl.prompts)} requests, seed {seed}, random prompt ids"]
    for label, dist, lens in (
        ("prompt", SIZES[size][1], [len(p) for p in wl.prompts]),
        ("output", SIZES[size][2], wl.out_lens),
    ):
        lines.append(
            f"#   {label} lengths: lognormal(median {dist[0]}, sigma {dist[1]}) clipped to "
            f"[{dist[2]}, {dist[3]}]: mean {sum(lens) / len(lens):.1f}, max {max(lens)}, "
            f"total {sum(lens)}"
        )
    return "\n".join(lines)


def make_llm(threads: int, max_num_seqs: int = 128, max_num_batched_tokens: int = 1024):
    from engine import LLM

    return LLM(
        MODEL,
        quantization=None,  # the exact weights, token for token against HF's
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,
        num_threads=threads,
    )


def tandem_mode(llm, wl: Workload) -> Callable[[], Run]:
    """Every request added at once, then `step()` until none is left (what `generate` does),
    sampling the KV utilization after each step outside the timing."""
    from engine import SamplingParams

    eng = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.out_lens]
    passes = [0]

    def run() -> Run:
        passes[0] += 1
        ids = [f"p{passes[0]}-r{i}" for i in range(len(wl.prompts))]
        stored = allocated = steps = prefill_steps = max_running = 0
        snapshot_s = 0.0
        preemptions = eng.scheduler.num_preemptions
        finals = {}
        t0 = time.perf_counter()
        for rid, prompt, p in zip(ids, wl.prompts, params, strict=True):
            eng.add_request(rid, prompt, p)
        while eng.has_unfinished_requests():
            # A step has prefill when some request has more than one token to compute.
            sched = eng.scheduler
            prefill_steps += bool(sched.waiting) or any(r.num_uncomputed > 1 for r in sched.running)
            for out in eng.step():
                if out.finished:
                    finals[out.request_id] = out
            steps += 1
            ts = time.perf_counter()
            snap = eng.snapshot()
            stored += snap["kv_tokens_stored"]
            allocated += snap["kv_slots_allocated"]
            max_running = max(max_running, snap["num_running"])
            snapshot_s += time.perf_counter() - ts
        seconds = time.perf_counter() - t0 - snapshot_s
        outputs = [list(finals[rid].outputs[0].token_ids) for rid in ids]
        info = dict(steps=steps, prefill_steps=prefill_steps, max_running=max_running)
        info.update(preemptions=eng.scheduler.num_preemptions - preemptions)
        info.update(kv_utilization=stored / allocated, snapshot_s=snapshot_s)
        return workload_run(seconds, outputs, **info)

    return run


def measure(
    wl: Workload,
    threads: int,
    repeats: int,
    modes: list[str],
    static_batch_size: int,
    hf_seq_limit: int | None = None,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 1024,
) -> dict[str, Timings]:
    """`modes` (tandem and HF_MODES) on `wl`, alternated, at `threads` torch threads (set before
    HF's continuous-batching thread starts, which keeps the count it finds)."""
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    runs: dict[str, Callable[[], Run]] = {}
    if "tandem" in modes:
        runs["tandem"] = tandem_mode(make_llm(threads, max_num_seqs, max_num_batched_tokens), wl)
    cb = None
    if any(m in HF_MODES for m in modes):
        model = load_hf_model()
        if "hf_seq" in modes:
            runs["hf_seq"] = hf_seq_mode(model, wl, hf_seq_limit)
        if "hf_static" in modes:
            runs["hf_static"] = hf_static_mode(model, wl, static_batch_size)
        if "hf_cb" in modes:
            runs["hf_cb"] = cb = ContinuousBatching(model, wl)
    try:
        return alternate(runs, repeats, threads=threads)
    finally:
        if cb is not None:
            cb.close()
        runs.clear()
        gc.collect()


def divergences(ours: list[list[int]], theirs: list[list[int]]) -> list[tuple[int, int]]:
    """(request, first differing output position) for every request both ran; `theirs` may
    cover only the first requests (hf_seq with a limit)."""
    found = []
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        at = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if at is None and len(a) != len(b):
            at = min(len(a), len(b))
        if at is not None:
            found.append((i, at))
    return found


def mismatches(timings: dict[str, Timings]) -> dict[str, list[tuple[int, int]]]:
    """Each HF mode whose token ids differ from tandem's, with where (see `divergences`)."""
    ours = timings["tandem"].outputs
    found = {m: divergences(ours, timings[m].outputs) for m in HF_MODES if m in timings}
    return {m: d for m, d in found.items() if d}


@torch.inference_mode()
def _margin(model, prompt: list[int], prefix: list[int]) -> tuple[float, int, int]:
    """HF's top-1 minus top-2 logit after prompt + prefix, and the two token ids."""
    logits = model(torch.tensor([prompt + prefix])).logits[0, -1].float()  # [vocab]
    top = torch.topk(logits, 2)
    return float(top.values[0] - top.values[1]), int(top.indices[0]), int(top.indices[1])


def explain(found: dict[str, list[tuple[int, int]]], timings, wl: Workload, margins: bool) -> str:
    """Every divergence: both tokens and (with `margins`) HF's top-2 logit margin there."""
    model = load_hf_model() if margins else None
    ours = timings["tandem"].outputs
    lines = []
    for name, where in found.items():
        lines.append(f"MISMATCH {name} against tandem: {len(where)} request(s) differ")
        for i, k in where:
            a, b = ours[i], timings[name].outputs[i]
            line = f"  request {i}: prompt {len(wl.prompts[i])}, output {wl.out_lens[i]}, at {k}"
            if k < len(a) and k < len(b):
                line += f" (tandem {a[k]}, {name} {b[k]})"
                if model is not None:
                    margin, t1, t2 = _margin(model, wl.prompts[i], a[:k])
                    line += f"; HF fresh-forward top-2 {t1}/{t2}, logit margin {margin:.4f}"
            lines.append(line)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench.throughput", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="--size quick: 24 shorter requests")
    ap.add_argument("--size", choices=list(SIZES), default=None, help="default full")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", default="1", help="comma-separated torch thread counts")
    ap.add_argument("--repeats", type=int, default=3, help="alternated rounds after a warm-up")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--static-batch-size", type=int, default=None, help="default: the size's")
    ap.add_argument("--hf-seq-limit", type=int, default=None, help="hf_seq: time K requests")
    ap.add_argument(
        "--modes", default="tandem,hf_static,hf_cb", help="of tandem," + ",".join(HF_MODES)
    )
    ap.add_argument("--no-margins", action="store_true", help="skip near-tie logit margins")
    args = ap.parse_args(argv)
    args.size = args.size or ("quick" if args.quick else "full")
    args.static_batch_size = args.static_batch_size or SIZES[args.size][3]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - {"tandem", *HF_MODES}
    if unknown or "tandem" not in args.modes:
        ap.error(f"--modes must include tandem and only tandem,{','.join(HF_MODES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wl = build_workload(args.size, args.num_requests, args.seed)
    print(f"# throughput bench: {MODEL}, fp32, torch {torch.__version__}, greedy, EOS ignored")
    print(describe(wl, args.size, args.seed))
    failed, first = False, None
    for threads in map(int, args.threads.split(",")):
        timings = measure(
            wl,
            threads,
            args.repeats,
            args.modes,
            args.static_batch_size,
            args.hf_seq_limit,
            args.max_num_seqs,
            args.max_num_batched_tokens,
        )
        print(f"-- {threads} thread(s), {args.repeats} rounds")
        print("wall seconds\n" + summary(timings, "seconds"))
        print("output tokens / s\n" + summary(timings, "tok_s", label="tok/s"))
        for name, t in timings.items():
            scalars = {k: round(v, 3) if isinstance(v, float) else v for k, v in t.info.items()}
            print(f"[{name}] {scalars}")
        found = mismatches(timings)
        if found:
            print(explain(found, timings, wl, not args.no_margins))
            failed = True
        else:
            print("token ids: every mode equals tandem's on every request it ran")
        first = first or timings

    def x(mode: str) -> str:
        if mode not in first:
            return "na"
        return f"{first['tandem'].median('tok_s') / first[mode].median('tok_s'):.3f}"

    kv = first["tandem"].info["kv_utilization"]
    print(
        f"RESULT throughput_x_hf_seq={x('hf_seq')} throughput_x_hf_static={x('hf_static')} "
        f"throughput_x_hf_cb={x('hf_cb')} kv_utilization={kv:.3f}"
    )
    return 1 if failed else 0


def _vocab_size(path) -> int:
    import json

    with open(os.path.join(str(path), "config.json")) as f:
        return int(json.load(f)["vocab_size"])


if __name__ == "__main__":
    sys.exit(main())
