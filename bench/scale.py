"""Scale-out on this machine: a model split over two tensor-parallel ranks against one rank.

    python -m bench.scale [--model qwen2.5-coder-0.5b-instruct] [--prompt-len 256]
                          [--tokens 32] [--batch 8] [--repeats 3] [--draft self]

The model dense in float32 (tensor parallelism splits dense weights), greedy, EOS ignored,
prefix caching off. Modes, alternated (bench/harness.py: a warm-up each, then --repeats rounds,
median and spread):
- tp1-t1: one rank on 1 thread; tp1-t2: one rank on 2 threads (the cores tp2 uses);
- tp2: two ranks, each a process on 1 thread, summing partial products over gloo twice a layer.
Work: one request (time to first token, time per output token) and --batch requests at once
(wall seconds). Every mode's tokens must equal tp1-t1's (exit 1 otherwise).
--draft self: every mode speculates with the model's own GGUF blocks (Q4_K_M) as its draft
(whole, on rank 0 alone: the draft is not split), adaptive k; the target's tokens are unchanged.
Tensor parallelism is for models larger than one device and for GPUs, whose all-reduce runs
over NVLink; on two CPU cores it competes with intra-op threads for the same cores and pays a
loopback all-reduce per projection, so it is expected to lose here: the point is the figure.
Last line: RESULT tp2_x_tp1_t2_per_token=.. tp2_x_tp1_t2_batch=.. (> 1 when tp2 is faster)
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

from bench.decode import engine_mode
from bench.harness import Run, Timings, alternate, summary, unequal
from bench.quality import held_tokens

MODEL = "qwen2.5-coder-0.5b-instruct"  # 14 query and 2 KV heads: splits in two
MODES = {"tp1-t1": (1, 1), "tp1-t2": (1, 2), "tp2": (2, 1)}  # (ranks, threads per rank)


def make_llm(model: str, ranks: int, max_len: int, draft: str | None = None):
    """A fixed KV budget: the model's fp32 weights take ~3.3 GB a copy, and the default share
    of free memory (10%) per engine would crowd two engines and a worker out of RAM."""
    from engine import LLM

    return LLM(
        model,
        quantization=None,
        num_threads=1,
        tensor_parallel_size=ranks,
        enable_prefix_caching=False,
        max_model_len=max_len,
        kv_cache_memory_bytes=512 << 20,
        draft_model=draft,
    )


def batch_mode(llm, prompts: list[list[int]], tokens: int) -> Callable[[], Run]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    def run() -> Run:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        ids = [o.outputs[0].token_ids for o in outs]
        return Run({"seconds": time.perf_counter() - t0}, ids, {"tokens": sum(map(len, ids))})

    return run


def on_threads(threads: int, mode: Callable[[], Run]) -> Callable[[], Run]:
    """The mode with this process's torch threads set first (the modes differ in them)."""

    def run() -> Run:
        torch.set_num_threads(threads)
        return mode()

    return run


def measure(
    model: str, prompt_len: int, tokens: int, batch: int, repeats: int, draft: str | None = None
) -> tuple[dict[str, Timings], dict[str, Timings]]:
    """(batch-1 timings, batch timings) of every mode, each work alternated over the modes."""
    # tp1-t1 and tp1-t2 share an engine
    engines = {r: make_llm(model, r, prompt_len + tokens, draft) for r in (1, 2)}
    llms = {name: engines[ranks] for name, (ranks, _) in MODES.items()}
    text = held_tokens(next(iter(llms.values())).tokenizer, prompt_len * (batch + 1))
    one = text[:prompt_len]
    prompts = [text[(i + 1) * prompt_len : (i + 2) * prompt_len] for i in range(batch)]
    single = {
        name: on_threads(MODES[name][1], engine_mode(llm, one, tokens))
        for name, llm in llms.items()
    }
    batched = {
        name: on_threads(MODES[name][1], batch_mode(llm, prompts, tokens))
        for name, llm in llms.items()
    }
    return alternate(single, repeats), alternate(batched, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft", default=None, help='a draft model for every mode, e.g. "self"')
    args = ap.parse_args()
    single, batched = measure(
        args.model, args.prompt_len, args.tokens, args.batch, args.repeats, args.draft
    )
    print(f"batch 1: {args.prompt_len}-token prompt, {args.tokens} new tokens; TTFT")
    print(summary(single, "ttft", 1e3, "ms"))
    print("per output token")
    print(summary(single, "per_token", 1e3, "ms"))
    print(f"batch {args.batch}: wall")
    print(summary(batched, "seconds"))
    others = [m for m in MODES if m != "tp1-t1"]
    bad = unequal(single, "tp1-t1", others) | unequal(batched, "tp1-t1", others)
    for name, where in bad.items():
        print(f"MISMATCH {name}: {where}")
    per_token = single["tp1-t2"].median("per_token") / single["tp2"].median("per_token")
    wall = batched["tp1-t2"].median("seconds") / batched["tp2"].median("seconds")
    print(f"RESULT tp2_x_tp1_t2_per_token={per_token:.2f} tp2_x_tp1_t2_batch={wall:.2f}")
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
