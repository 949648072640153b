"""Sampled decoding against greedy, against HF, and top-p with and without its shortcut.

    python -m bench.sampling [--requests 32] [--tokens 48] [--repeats 3]

SmolLM2-135M-Instruct (real weights, float32, one thread), 32 chat prompts in one batch, 48 new
tokens each, EOS ignored. Four runs of the engine on the same requests:

- greedy: temperature 0 (the argmax path);
- top_p: temperature 0.8, top-p 0.95, a seed per request;
- top_p_full_sort: the same with `engine.sampler.TOP_P_CANDIDATES` past the vocabulary, so every
  row is sorted in full (what top-p cost before the shortcut; the tokens must be the same);
- penalties: top_p plus repetition 1.1, frequency 0.2, presence 0.2, a logit bias, min_tokens 8
  and 2 logprobs per token;

and HF `generate` on the same prompts as one left-padded static batch (its default sdpa
attention and dynamic cache), greedy and with do_sample (temperature 0.8, top-p 0.95).

Fair by construction: the engine's prefix cache is off (the prompts repeat 8 topics, and HF
recomputes every prompt), one warm-up of every mode first, then --repeats rounds in which all
six modes run in turn; each figure is the median over the rounds, with its spread (max - min).
Exits 1 if top_p and top_p_full_sort (same seeds, same rule) differ in any token.

Last line:
    RESULT top_p_x_greedy=.. top_p_x_hf_sampled=.. candidates_x_full_sort=.. penalties_x_top_p=..
(x: ratios of tokens per second, > 1 when the first is faster)
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import time

import torch

from bench.hf_baselines import generate, load_hf_model
from bench.workload import MODEL

TOPICS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash map works.",
    "List five fruits and their colors.",
    "What is the capital of France? Answer briefly.",
    "Describe the water cycle.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
]


def engine_modes(tokens: int) -> dict:
    from engine import SamplingParams

    def top_p(i: int, **extra) -> SamplingParams:
        return SamplingParams(
            temperature=0.8, top_p=0.95, seed=i, max_tokens=tokens, ignore_eos=True, **extra
        )

    penalties = dict(
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        presence_penalty=0.2,
        logit_bias={28: 1.0},
        min_tokens=8,
        logprobs=2,
    )
    return {
        "greedy": lambda i: SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
        "top_p": top_p,
        "top_p_full_sort": top_p,
        "penalties": lambda i: top_p(i, **penalties),
    }


def run_engine(llm, prompts: list[list[int]], params) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def run_hf(model, prompts: list[list[int]], tokens: int, sampled: bool) -> float:
    """HF `generate` on the prompts as one left-padded batch: wall seconds. EOS is kept out by
    min_new_tokens, as when this benchmark was first measured (nothing compares HF's tokens)."""
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.95, top_k=0) if sampled else {}
    t0 = time.perf_counter()
    generate(model, prompts, tokens, ignore_eos=False, min_new_tokens=tokens, **kwargs)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from engine import LLM, sampler

    llm = LLM(
        MODEL,
        quantization=None,
        num_threads=1,
        max_num_seqs=args.requests,
        enable_prefix_caching=False,
    )
    hf = load_hf_model()
    prompts = [
        llm.apply_chat_template([{"role": "user", "content": TOPICS[i % len(TOPICS)]}])
        for i in range(args.requests)
    ]
    modes = engine_modes(args.tokens)
    candidates = sampler.TOP_P_CANDIDATES

    def run(name: str) -> tuple[float, list[list[int]] | None]:
        if name.startswith("hf_"):
            return run_hf(hf, prompts, args.tokens, name == "hf_top_p"), None
        sampler.TOP_P_CANDIDATES = 1 << 30 if name == "top_p_full_sort" else candidates
        try:
            return run_engine(llm, prompts, [modes[name](i) for i in range(args.requests)])
        finally:
            sampler.TOP_P_CANDIDATES = candidates

    names = [*modes, "hf_greedy", "hf_top_p"]
    for name in names:  # warm-up, every mode alike
        run(name)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    ids = {}
    for _ in range(args.repeats):
        for name in names:
            dt, ids[name] = run(name)
            seconds[name].append(dt)
    total = args.requests * args.tokens
    median = {name: statistics.median(v) for name, v in seconds.items()}
    for name, values in seconds.items():
        spread, tok_s = max(values) - min(values), total / median[name]
        print(f"{name:16s} {median[name]:7.2f} s (spread {spread:.2f})  {tok_s:7.1f} tok/s")
    same = sum(a == b for a, b in zip(ids["top_p"], ids["top_p_full_sort"], strict=True))
    print(f"top_p tokens equal with and without the shortcut: {same}/{args.requests}")
    print(
        f"RESULT top_p_x_greedy={median['greedy'] / median['top_p']:.2f} "
        f"top_p_x_hf_sampled={median['hf_top_p'] / median['top_p']:.2f} "
        f"candidates_x_full_sort={median['top_p_full_sort'] / median['top_p']:.2f} "
        f"penalties_x_top_p={median['top_p'] / median['penalties']:.2f}"
    )
    return 0 if same == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
