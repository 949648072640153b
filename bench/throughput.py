"""Offline throughput: the Tandem engine against HF transformers on a ShareGPT-like workload.

    python -m bench.throughput [--quick] [--num-requests N] [--seed S]
    tandem bench throughput [--quick]

N requests of random token-id prompts with lognormal prompt/output lengths, greedy decoding,
EOS ignored (every request generates exactly its own output length). Modes, all on one thread:

- tandem: `LLMEngine` driven with add_request/step, all requests submitted at once; the KV
  utilization (tokens stored / slots allocated) is sampled after every step via `snapshot()`.
- hf_seq: `model.generate` one request at a time (batch 1).
- hf_static: `model.generate` on static batches in arrival order, left padded; every batch runs
  to its longest output and each request keeps only its own length (only useful tokens count).
- hf_cb: transformers' continuous batching (paged attention), one request per output length.

HF ignores EOS through an unreachable eos_token_id (hf_seq, hf_static) or eos_token_id=-1
(hf_cb); `min_new_tokens` would instead mask EOS out of the argmax and change greedy tokens.

Throughput is output tokens / wall seconds (model loading and cache allocation excluded). The
last line is machine-readable:
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
import traceback

import torch

from bench.hf_baselines import eos_id, load_hf_model, run_hf_cb, run_hf_seq, run_hf_static
from bench.workload import MODEL, ModeResult, Workload, make_workload

# ---- modes -------------------------------------------------------------------------------


def run_tandem(wl: Workload, args) -> tuple[ModeResult, float | None]:
    from engine import LLM, SamplingParams

    res = ModeResult("tandem")
    llm = LLM(
        MODEL,
        quantization=None,  # the exact weights, token for token against HF's
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        num_threads=1,
    )
    eng = llm.engine
    res.notes.append(
        f"max_num_seqs={args.max_num_seqs} max_num_batched_tokens={args.max_num_batched_tokens} "
        f"block_size={eng.config.block_size} kv_blocks={eng.kv.pool.num_usable} "
        "prefix_caching=off"
    )
    # Warm-up (one-time lazy initialisation in torch), not timed.
    llm.generate(
        [wl.prompts[0][:16]],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    params = [SamplingParams(temperature=0, max_tokens=L, ignore_eos=True) for L in wl.out_lens]
    stored = allocated = 0
    snap_s = 0.0
    steps = prefill_steps = 0
    max_running = 0
    preempt0 = eng.scheduler.num_preemptions
    step_s = {"mixed": 0.0, "decode": 0.0}
    finals = {}
    t0 = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(wl.prompts, params, strict=True)):
        eng.add_request(f"bench-{i}", prompt, p)
    while eng.has_unfinished_requests():
        ts = time.perf_counter()
        # A step is "mixed" when some request has more than one token to compute (prefill).
        sched = eng.scheduler
        mixed = bool(sched.waiting) or any(r.num_uncomputed > 1 for r in sched.running)
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
        te = time.perf_counter()
        step_s["mixed" if mixed else "decode"] += te - ts
        prefill_steps += mixed
        steps += 1
        snap = eng.snapshot()  # sampled every step, its cost is excluded from the timing
        stored += snap["kv_tokens_stored"]
        allocated += snap["kv_slots_allocated"]
        max_running = max(max_running, snap["num_running"])
        snap_s += time.perf_counter() - te
    wall = time.perf_counter() - t0 - snap_s
    for i in range(len(wl.prompts)):
        res.outputs[i] = list(finals[f"bench-{i}"].outputs[0].token_ids)
    res.seconds = wall
    res.tally(wl)
    if res.output_tokens != wl.num_output_tokens:
        res.notes.append(f"WARNING: generated {res.output_tokens}, wanted {wl.num_output_tokens}")
    kv_util = stored / allocated if allocated else None
    res.notes.append(
        f"{steps} steps ({prefill_steps} with prefill: {step_s['mixed']:.1f}s, "
        f"{steps - prefill_steps} decode-only: {step_s['decode']:.1f}s), "
        f"max running {max_running}, preemptions {eng.scheduler.num_preemptions - preempt0}, "
        f"snapshot overhead {snap_s:.2f}s (excluded)"
    )
    del llm, eng
    gc.collect()
    return res, kv_util


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def _margin(model, prompt: list[int], prefix: list[int]) -> tuple[float, int, int]:
    """HF's top-1 minus top-2 logit after prompt + prefix, and the two token ids."""
    logits = model(torch.tensor([prompt + prefix])).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return float(top.values[0] - top.values[1]), int(top.indices[0]), int(top.indices[1])


def compare(
    ours: ModeResult, ref: ModeResult, wl: Workload, model=None, eos: int | None = None
) -> list[str]:
    common = sorted(set(ours.outputs) & set(ref.outputs))
    if not common:
        return []
    lines = []
    mismatches = []
    for i in common:
        k = first_divergence(ours.outputs[i], ref.outputs[i])
        if k is not None:
            mismatches.append((i, k))
    lines.append(
        f"{ours.name} vs {ref.name}: {len(common) - len(mismatches)}/{len(common)} requests "
        "match exactly"
    )
    for i, k in mismatches:
        a, b = ours.outputs[i], ref.outputs[i]
        msg = (
            f"  request {i}: prompt {len(wl.prompts[i])}, output {wl.out_lens[i]}, first "
            f"divergence at output token {k}"
        )
        if k < len(a) and k < len(b):
            msg += f" ({ours.name} {a[k]}, {ref.name} {b[k]})"
            if eos is not None and a[k] == eos:
                msg += " [EOS]"
            if model is not None:
                margin, t1, t2 = _margin(model, wl.prompts[i], a[:k])
                msg += f"; HF fresh-forward top-2 {t1}/{t2}, logit margin {margin:.4f}"
        lines.append(msg)
    return lines


# ---- report ------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def format_table(results: list[ModeResult]) -> str:
    ours = next((r for r in results if r.name == "tandem"), None)
    head = "| mode | requests | seconds | out tok/s | total tok/s | tandem x |"
    rows = [head, "|---|---|---|---|---|---|"]
    for r in results:
        speedup = None
        if ours is not None and ours.ok and r.ok:
            speedup = ours.out_tok_s / r.out_tok_s
        reqs = str(r.num_requests) + (" (extrapolated)" if r.extrapolated else "")
        if r.error:
            reqs = f"n/a ({r.error})"
        rows.append(
            f"| {r.name} | {reqs} | {_fmt(r.seconds, '.1f')} | {_fmt(r.out_tok_s)} | "
            f"{_fmt(r.total_tok_s)} | {_fmt(speedup, '.2f')} |"
        )
    return "\n".join(rows)


def _ratio(ours: ModeResult | None, other: ModeResult | None) -> str:
    if ours is None or other is None or not ours.ok or not other.ok:
        return "n/a"
    return f"{ours.out_tok_s / other.out_tok_s:.3f}"


# ---- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench.throughput", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="24 shorter requests, under 5 minutes")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--static-batch-size", type=int, default=None, help="default 32 (quick: 16)")
    ap.add_argument(
        "--hf-seq-limit",
        type=int,
        default=None,
        help="time only the first K requests in hf_seq and extrapolate (default: all)",
    )
    ap.add_argument(
        "--modes",
        default="tandem,hf_seq,hf_static,hf_cb",
        help="comma-separated subset of tandem,hf_seq,hf_static,hf_cb",
    )
    ap.add_argument("--no-margins", action="store_true", help="skip near-tie logit margins")
    args = ap.parse_args(argv)
    # The defaults that --quick changes.
    args.num_requests = args.num_requests or (24 if args.quick else 64)
    args.static_batch_size = args.static_batch_size or (16 if args.quick else 32)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - {"tandem", "hf_seq", "hf_static", "hf_cb"}
    if unknown:
        print(f"unknown modes: {sorted(unknown)}", file=sys.stderr)
        return 2

    wl = build_workload(args.num_requests, args.seed, args.quick)
    ours, kv_util = run_tandem_mode(wl, args) if "tandem" in modes else (None, None)
    hf_modes = [m for m in ("hf_seq", "hf_static", "hf_cb") if m in modes]
    model, hf = run_hf_modes(wl, args, hf_modes)
    results = ([ours] if ours is not None else []) + list(hf.values())

    print(f"# load average at end: {_loadavg()}")
    print_correctness(results, wl, model, args.no_margins)
    print_throughput(results, kv_util)
    print(
        f"RESULT throughput_x_hf_seq={_ratio(ours, hf.get('hf_seq'))} "
        f"throughput_x_hf_static={_ratio(ours, hf.get('hf_static'))} "
        f"throughput_x_hf_cb={_ratio(ours, hf.get('hf_cb'))} "
        f"kv_utilization={_fmt(kv_util, '.3f')}"
    )
    return 0 if ours is not None and ours.ok else 1


def build_workload(n: int, seed: int, quick: bool) -> Workload:
    """n requests with lognormal (median, sigma, min, max) prompt and output lengths, shorter
    with --quick; prints what it drew."""
    from engine.models.registry import resolve_model

    if quick:
        prompt_dist, output_dist = (64, 0.7, 16, 256), (28, 0.7, 8, 80)
    else:
        prompt_dist, output_dist = (100, 0.8, 16, 512), (80, 0.8, 8, 256)
    vocab = _vocab_size(resolve_model(MODEL))
    wl = make_workload(n, seed, vocab, prompt_dist, output_dist)
    print(
        f"# throughput bench: {MODEL}, fp32, torch threads={torch.get_num_threads()}, "
        f"torch {torch.__version__}"
    )
    print(f"# load average at start: {_loadavg()}")
    print(
        f"# workload: {n} requests, seed {seed}, random prompt ids in [100, {vocab - 100}), "
        "greedy, EOS ignored"
    )
    for label, dist, lens in (
        ("prompt", prompt_dist, [len(p) for p in wl.prompts]),
        ("output", output_dist, wl.out_lens),
    ):
        print(
            f"#   {label} lengths: lognormal(median {dist[0]}, sigma {dist[1]}) clipped to "
            f"[{dist[2]}, {dist[3]}]: mean {sum(lens) / n:.1f}, median "
            f"{sorted(lens)[n // 2]}, min {min(lens)}, max {max(lens)}, total {sum(lens)}"
        )
    sys.stdout.flush()
    return wl


def run_tandem_mode(wl: Workload, args) -> tuple[ModeResult, float | None]:
    """run_tandem, with a failure reported as the mode's error instead of raised."""
    kv_util = None
    try:
        ours, kv_util = run_tandem(wl, args)
    except Exception as e:  # keep going: the HF modes still report
        traceback.print_exc()
        ours = ModeResult("tandem", error=f"{type(e).__name__}: {e}"[:120])
    _print_mode(ours)
    return ours, kv_util


def run_hf_modes(wl: Workload, args, hf_modes: list[str]) -> tuple[object, dict[str, ModeResult]]:
    """The HF baselines asked for, in order, a failure reported as the mode's error: (the HF
    model, None if none was loaded; results by mode)."""
    if not hf_modes:
        return None, {}
    try:
        model = load_hf_model()
    except Exception as e:
        traceback.print_exc()
        hf = {m: ModeResult(m, error=f"model load failed: {type(e).__name__}") for m in hf_modes}
        for r in hf.values():
            _print_mode(r)
        return None, hf
    runners = {
        "hf_seq": lambda: run_hf_seq(model, wl, args.hf_seq_limit),
        "hf_static": lambda: run_hf_static(model, wl, args.static_batch_size),
        "hf_cb": lambda: run_hf_cb(model, wl),
    }
    hf: dict[str, ModeResult] = {}
    for m in hf_modes:
        try:
            hf[m] = runners[m]()
        except Exception as e:
            traceback.print_exc()
            hf[m] = ModeResult(m, error=f"{type(e).__name__}: {e}"[:120])
        gc.collect()
        _print_mode(hf[m])
    return model, hf


def print_correctness(results: list[ModeResult], wl: Workload, model, no_margins: bool) -> None:
    """Token ids of every pair of modes that both ran; HF's logit margins at tandem's
    divergences from hf_seq (unless no_margins)."""
    print("\n## correctness (token ids, greedy)")
    eos = eos_id(model) if model is not None else None
    pairs = [("tandem", "hf_seq"), ("tandem", "hf_static"), ("tandem", "hf_cb")]
    pairs += [("hf_static", "hf_seq"), ("hf_cb", "hf_seq")]
    by_name = {r.name: r for r in results}
    for a, b in pairs:
        ra, rb = by_name.get(a), by_name.get(b)
        if ra is None or rb is None or not ra.ok or not rb.ok:
            continue
        with_margins = model if (not no_margins and b == "hf_seq" and a == "tandem") else None
        for line in compare(ra, rb, wl, with_margins, eos):
            print(line)


def print_throughput(results: list[ModeResult], kv_util: float | None) -> None:
    print("\n## throughput (output tokens / wall seconds; 'tandem x' = tandem out tok/s / mode's)")
    print(format_table(results))
    if kv_util is not None:
        print(f"tandem KV utilization (tokens stored / slots allocated, all steps): {kv_util:.3f}")


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} cpus)"
    except OSError:
        return "n/a"


def _vocab_size(path) -> int:
    import json

    with open(os.path.join(str(path), "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def _print_mode(r: ModeResult) -> None:
    if r.error:
        print(f"[{r.name}] n/a: {r.error}")
    else:
        print(
            f"[{r.name}] {r.num_requests} requests, {r.output_tokens} output tokens in "
            f"{r.seconds:.1f}s: {r.out_tok_s:.2f} out tok/s, {r.total_tok_s:.2f} total tok/s"
        )
    for note in r.notes:
        print(f"[{r.name}]   {note}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
