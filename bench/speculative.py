"""Speculative decoding: batch-1 latency and batched throughput with and without speculation.

    python -m bench.speculative [--parts ngram,draft,sweep] [--max-tokens N] [--k K]

One thread, greedy, the same prompts with and without speculation in the same run (outputs are
checked equal token for token):

- ngram: SmolLM2-135M-Instruct on input-grounded chat prompts (rewrite / extract / fix a text
  given in the prompt), prompt-lookup drafts;
- draft: Qwen2.5-Coder-1.5B-Instruct target with the 0.5B as draft model, on code prompts
  (completion, and edit-style prompts that repeat their input);
- sweep: SmolLM2 with n-gram speculation at batch 1, 4, 16, 64 against no speculation.

Per-token latency = wall seconds / output tokens for one request at a time. Last line:
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


def compare_latency(name, make_llm, texts, params, spec_args) -> dict:
    from engine import LLM

    base = LLM(name, **make_llm)
    prompts = chat_prompts(base, texts)
    latency(base, prompts[:1], params)  # warm-up
    t_base, want = latency(base, prompts, params)
    del base
    gc.collect()
    spec = LLM(name, **make_llm, **spec_args)
    latency(spec, prompts[:1], params)
    spec.engine.spec_stats.__init__()  # count the timed runs only
    t_spec, got = latency(spec, prompts, params)
    stats = spec.engine.spec_stats
    return {
        "ms_per_token_base": 1e3 * t_base,
        "ms_per_token_spec": 1e3 * t_spec,
        "speedup": t_base / t_spec,
        "equal": sum(a == b for a, b in zip(want, got, strict=True)),
        "n": len(want),
        "acceptance_by_position": stats.acceptance_by_position,
        "mean_accepted_length": stats.mean_accepted_length,
        "draft_s": spec.engine.spec_time["draft"],
        "target_s": spec.engine.spec_time["verify"],
    }


def sweep(batches, k, max_tokens) -> dict[int, float]:
    """Throughput ratio spec / plain at each batch size (n-gram, SmolLM2)."""
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ratios = {}
    llms = {
        "plain": LLM(SMOLLM, kv_cache_memory_bytes=1 << 30),
        "spec": LLM(
            SMOLLM,
            kv_cache_memory_bytes=1 << 30,
            speculative_method="ngram",
            num_speculative_tokens=k,
        ),
    }
    prompts = chat_prompts(llms["plain"], GROUNDED)
    for b in batches:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        times = {}
        for mode, llm in llms.items():
            llm.generate(batch[:1], params, use_tqdm=False)
            t0 = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            times[mode] = (time.perf_counter() - t0) / sum(
                len(o.outputs[0].token_ids) for o in outs
            )
        ratios[b] = times["plain"] / times["spec"]
        print(
            f"[sweep] batch {b}: plain {1e3 * times['plain']:.1f} ms/token, "
            f"spec {1e3 * times['spec']:.1f} ms/token, speedup {ratios[b]:.2f}x",
            flush=True,
        )
    return ratios


def report(label: str, r: dict) -> None:
    pos = ", ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
    print(
        f"[{label}] {r['ms_per_token_base']:.1f} -> {r['ms_per_token_spec']:.1f} ms/token: "
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
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    parts = set(args.parts.split(","))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    out = {"draft": "n/a", "ngram": "n/a", "slow": "n/a", "mal": "n/a"}
    kv = {"kv_cache_memory_bytes": 512 << 20}
    if "ngram" in parts:
        r = compare_latency(
            SMOLLM,
            kv,
            GROUNDED,
            params,
            {"speculative_method": "ngram", "num_speculative_tokens": args.k},
        )
        report("ngram", r)
        out["ngram"], out["mal"] = f"{r['speedup']:.3f}", f"{r['mean_accepted_length']:.3f}"
    if "draft" in parts:
        r = compare_latency(
            TARGET, kv, CODE, params, {"draft_model": DRAFT, "num_speculative_tokens": args.k}
        )
        report("draft", r)
        out["draft"], out["mal"] = f"{r['speedup']:.3f}", f"{r['mean_accepted_length']:.3f}"
    if "sweep" in parts:
        ratios = sweep([int(b) for b in args.batches.split(",")], args.k, args.max_tokens)
        out["slow"] = f"{max(0.0, 1.0 - min(ratios.values())):.3f}"
    print(
        f"RESULT spec_speedup_draft={out['draft']} spec_speedup_ngram={out['ngram']} "
        f"worst_batch_slowdown={out['slow']} mean_accept_len={out['mal']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
