"""Speculative decoding: batch-1 latency and batched throughput with and without speculation.

    python -m bench.speculative [--parts ngram,draft,sweep] [--max-tokens N] [--k K]

One thread, greedy, the same prompts with and without speculation in the same run (outputs are
checked equal token for token):

- ngram: SmolLM2-135M-Instruct on input-grounded chat prompts (rewrite / extract / fix a text
  given in the prompt), prompt-lookup drafts;
- draft: Qwen2.5-Coder-1.5B-Instruct target with the 0.5B as draft model, on code prompts
  (completion, and edit-style prompts that repeat their input);
- sweep: SmolLM2 with n-gram speculation at batch 1, 4, 16, 64 on distinct prompts, two
  workloads: "mixed" (half input-grounded, where drafts land, half open-ended, where they mostly
  do not) and "open" (open-ended only).

Each part runs three modes on the same prompts: plain (no speculation), fixed (k drafts every
step) and adaptive (the engine default: k per request and step from measured acceptance and step
costs, capped at k). Per-token latency = wall seconds / output tokens for one request at a time;
sweep throughput = output tokens / s of the whole batch, best of --repeats alternating runs.
The RESULT speedups are adaptive's; worst_batch_slowdown = max(0, 1 - adaptive / plain
throughput) over the sweep's batch sizes and workloads. Last line:
    RESULT spec_speedup_draft=.. spec_speedup_ngram=.. worst_batch_slowdown=.. mean_accept_len=..
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import gc
import time

import torch

SMOLLM = "smollm2-135m-instruct"
TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"

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


def latency(llm, prompts, params) -> tuple[float, list[list[int]]]:
    """Seconds per output token, one request at a time (batch 1)."""
    seconds = tokens = 0.0
    outs = []
    for prompt in prompts:
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        seconds += time.perf_counter() - t0
        tokens += len(out.token_ids)
        outs.append(out.token_ids)
    return seconds / tokens, outs


def spec_modes(spec_args: dict, k: int) -> dict[str, dict]:
    """Engine arguments per mode: no speculation, a fixed k, adaptive with k as the cap."""
    return {
        "plain": {},
        "fixed": {**spec_args, "num_speculative_tokens": k, "adaptive_speculation": False},
        "adaptive": {**spec_args, "num_speculative_tokens": k, "adaptive_speculation": True},
    }


def compare_latency(name, make_llm, texts, params, spec_args, k) -> dict:
    """Batch-1 seconds per token in each mode, one engine alive at a time."""
    from engine import LLM

    out = {}
    want = None
    for mode, args in spec_modes(spec_args, k).items():
        llm = LLM(name, quantization=None, **make_llm, **args)
        prompts = chat_prompts(llm, texts)
        latency(llm, prompts[:1], params)  # warm-up (and the adaptive planner's first fits)
        llm.engine.speculation.stats.__init__()  # count the timed runs only
        llm.engine.speculation.seconds.update(draft=0.0, verify=0.0)
        seconds, got = latency(llm, prompts, params)
        want = want or got
        stats = llm.engine.speculation.stats
        out[mode] = {
            "ms_per_token": 1e3 * seconds,
            "equal": sum(a == b for a, b in zip(want, got, strict=True)),
            "n": len(want),
            "acceptance_by_position": stats.acceptance_by_position,
            "mean_accepted_length": stats.mean_accepted_length,
            "draft_s": llm.engine.speculation.seconds["draft"],
            "target_s": llm.engine.speculation.seconds["verify"],
        }
        del llm
        gc.collect()
    for mode in out:
        out[mode]["speedup"] = out["plain"]["ms_per_token"] / out[mode]["ms_per_token"]
    return out


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


def draft_share(engine) -> float:
    """Share of decode request-steps that carried drafts."""
    stats = engine.speculation.stats
    request_steps = engine.num_generated_tokens - stats.num_accepted
    return stats.num_steps / request_steps if request_steps else 0.0


def sweep(batches, k, max_tokens, repeats, workload) -> dict[int, dict[str, float]]:
    """Throughput (output tokens / s) of each mode at each batch size: n-gram on SmolLM2."""
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llms = {
        mode: LLM(SMOLLM, quantization=None, kv_cache_memory_bytes=1 << 30, **args)
        for mode, args in spec_modes({"speculative_method": "ngram"}, k).items()
    }
    results = {}
    for b in batches:
        prompts = sweep_prompts(llms["plain"], b, workload)
        best = dict.fromkeys(llms, float("inf"))
        share, equal, want = {}, {}, None
        for _ in range(repeats):  # alternate the modes so that load changes hit them alike
            for mode, llm in llms.items():
                llm.generate(prompts[:1], params, use_tqdm=False)
                llm.engine.speculation.stats.__init__()
                llm.engine.num_generated_tokens = 0
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - t0
                got = [o.outputs[0].token_ids for o in outs]
                want = want or got
                equal[mode] = sum(a == w for a, w in zip(got, want, strict=True))
                best[mode] = min(best[mode], seconds / sum(len(t) for t in got))
                share[mode] = draft_share(llm.engine)
        ratio = {mode: best["plain"] / best[mode] for mode in llms}
        results[b] = ratio
        print(
            f"[sweep/{workload}] batch {b}: plain {1e3 * best['plain']:.1f} ms/token; fixed k={k} "
            f"{ratio['fixed']:.2f}x ({share['fixed']:.0%} of steps drafted); adaptive "
            f"{ratio['adaptive']:.2f}x ({share['adaptive']:.0%} drafted); outputs equal to "
            f"plain {min(equal.values())}/{b}",
            flush=True,
        )
    return results


def report(label: str, modes: dict) -> None:
    base = modes["plain"]["ms_per_token"]
    for mode in ("fixed", "adaptive"):
        r = modes[mode]
        pos = ", ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        print(
            f"[{label}/{mode}] {base:.1f} -> {r['ms_per_token']:.1f} ms/token: "
            f"{r['speedup']:.2f}x; outputs equal {r['equal']}/{r['n']}; mean accepted length "
            f"{r['mean_accepted_length']:.2f}; acceptance by position [{pos}]; "
            f"draft {r['draft_s']:.1f}s / target {r['target_s']:.1f}s",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    from engine import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="ngram,draft,sweep")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=2, help="sweep runs per mode (best kept)")
    ap.add_argument("--sweep-tokens", type=int, default=64, help="max_tokens in the sweep")
    ap.add_argument("--workloads", default="mixed,open", help="sweep workloads")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    parts = set(args.parts.split(","))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    out = {"draft": "n/a", "ngram": "n/a", "slow": "n/a", "mal": "n/a"}
    kv = {"kv_cache_memory_bytes": 512 << 20}
    # The headline speedups are adaptive speculation's, the engine's default mode.
    if "ngram" in parts:
        modes = compare_latency(
            SMOLLM, kv, GROUNDED, params, {"speculative_method": "ngram"}, args.k
        )
        report("ngram", modes)
        r = modes["adaptive"]
        out["ngram"], out["mal"] = f"{r['speedup']:.3f}", f"{r['mean_accepted_length']:.3f}"
    if "draft" in parts:
        modes = compare_latency(TARGET, kv, CODE, params, {"draft_model": DRAFT}, args.k)
        report("draft", modes)
        r = modes["adaptive"]
        out["draft"], out["mal"] = f"{r['speedup']:.3f}", f"{r['mean_accepted_length']:.3f}"
    if "sweep" in parts:
        batches = [int(b) for b in args.batches.split(",")]
        worst = 1.0
        for workload in args.workloads.split(","):
            results = sweep(batches, args.k, args.sweep_tokens, args.repeats, workload)
            worst = min(worst, *(r["adaptive"] for r in results.values()))
        out["slow"] = f"{max(0.0, 1.0 - worst):.3f}"
    print(
        f"RESULT spec_speedup_draft={out['draft']} spec_speedup_ngram={out['ngram']} "
        f"worst_batch_slowdown={out['slow']} mean_accept_len={out['mal']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
