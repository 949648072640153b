"""The prefix cache: one request whose long prefix is cached against the same request cold, and
a burst of requests sharing a system prompt.

    python -m bench.shared_prefix [--prefix-lens 512,1024,2048] [--threads 1] [--repeats 3]
                                  [--requests 16] [--prefix 384] [--tail 24] [--max-tokens 16]
                                  [--no-burst]

SmolLM2-135M fp32, greedy, EOS ignored; modes alternated (bench/harness.py: a warm-up each, then
--repeats rounds, median and spread).

One request (per --prefix-lens): a shared prefix of real English text (bench/quality.py) and a
tail of --tail tokens that no earlier request had, --max-tokens new tokens. Modes:
- cold: prefix caching off: the whole prompt is computed;
- cached: prefix caching on, the shared prefix already in the cache from an earlier request with
  another tail: only the tail (and the prefix's last partial block) is computed.
Both modes run the same sequence of prompts (run k of each has the same tail), and every run's
token ids must be equal between them (exit 1 otherwise), and the cached mode must have found
the prefix's whole blocks in the cache. Time to first token and the request's total seconds.

The burst: --requests requests of --prefix shared random ids + --tail own ids, all at once:
- tandem: prefix caching as it ships: blocks are registered in the prefix cache when a step
  allocates them, so requests admitted in the same step share what the first computes;
- tandem_after_step: blocks registered only once computed (the engine before same-step sharing):
  the burst's first step computes the prefix once per request that fits the token budget;
- tandem_no_cache: prefix caching off;
- hf_static: HF transformers `generate` over the whole burst as one left-padded batch.
Every run of a caching mode starts from an empty prefix cache. Wall time and the prompt tokens
the engine computed; every mode's tokens must equal HF's (exit 1 otherwise).

Last line: RESULT cached_x_cold_ttft=.. (first prefix length and thread count)
same_step_x_after_step=.. same_step_x_no_cache=.. x_hf_static=.. (seconds ratios, > 1 when the
first named is faster)
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from unittest import mock

import torch

from bench.harness import Run, Timings, alternate, first_difference, summary, unequal
from bench.hf_baselines import hf_static_mode, load_hf_model
from bench.workload import MODEL, Workload


def make_llm(caching: bool, threads: int):
    from engine import LLM

    return LLM(MODEL, quantization=None, enable_prefix_caching=caching, num_threads=threads)


def params(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# ---- one request: cold against a cached prefix ---------------------------------------------


def prefix_prompts(prefix_len: int, tail_len: int, num_prompts: int) -> list[list[int]]:
    """`num_prompts` prompts: the held text's first `prefix_len` tokens, then each its own next
    `tail_len` tokens of that text."""
    from bench.decode import prompt_ids, tokenizer

    ids = prompt_ids(tokenizer(), prefix_len + tail_len * num_prompts)
    prefix, tails = ids[:prefix_len], ids[prefix_len:]
    return [prefix + tails[i * tail_len : (i + 1) * tail_len] for i in range(num_prompts)]


def request_mode(llm, prompts: list[list[int]], max_tokens: int) -> Callable[[], Run]:
    """Each call streams the next of `prompts`: time to first token, total seconds, and how many
    prompt tokens the prefix cache supplied."""
    queue = iter(prompts)

    def run() -> Run:
        prompt = next(queue)
        stamps, ids, cached = [], [], 0
        t0 = time.perf_counter()
        for delta in llm.stream(prompt, params(max_tokens)):
            stamps.append(time.perf_counter())
            ids += delta.outputs[0].token_ids
            cached = delta.num_cached_tokens
        metrics = {"ttft": stamps[0] - t0, "total": stamps[-1] - t0}
        info = {"tokens": len(ids), "prompt_tokens": len(prompt), "cached_tokens": cached}
        info["computed_tokens"] = len(prompt) - cached
        return Run(metrics, [ids], info)

    return run


def measure_cached(
    prefix_len: int, threads: int, tail_len: int, max_tokens: int, repeats: int
) -> dict[str, Timings]:
    """cold and cached (see the module doc), alternated. Prompt 0 only primes the cached engine;
    the warm-up and every round then take the next prompt, the same one in both modes."""
    torch.set_num_threads(threads)
    prompts = prefix_prompts(prefix_len, tail_len, 2 + repeats)  # priming, warm-up, rounds
    cold, cached = make_llm(False, threads), make_llm(True, threads)
    cached.generate([prompts[0]], params(max_tokens), use_tqdm=False)
    modes = {
        "cold": request_mode(cold, prompts[1:], max_tokens),
        "cached": request_mode(cached, prompts[1:], max_tokens),
    }
    timings = alternate(modes, repeats, threads=threads)
    timings["cached"].info["expected_cached_tokens"] = expected_cached(cached, prefix_len)
    return timings


def expected_cached(llm, prefix_len: int) -> int:
    """The prefix's whole blocks: the cache holds blocks, a partial one is computed again."""
    block_size = llm.engine.config.block_size
    return prefix_len // block_size * block_size


def cached_problems(timings: dict[str, Timings]) -> list[str]:
    """Every run whose tokens differ between cold and cached, and cached runs that did not find
    the whole prefix in the cache."""
    problems = []
    cold, cached = timings["cold"].runs, timings["cached"].runs
    for k, (a, b) in enumerate(zip(cold, cached, strict=True)):
        diff = first_difference(a.outputs, b.outputs)
        if diff:
            problems.append(f"round {k}: cached against cold: {diff}")
    want = timings["cached"].info["expected_cached_tokens"]
    for k, run in enumerate(cached):
        if run.info["cached_tokens"] != want:
            problems.append(f"round {k}: {run.info['cached_tokens']} tokens cached, not {want}")
    return problems


# ---- a burst sharing a system prompt -------------------------------------------------------


def burst(num_requests: int, prefix_len: int, tail_len: int, max_tokens: int) -> Workload:
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(prefix_len)]
    tails = [[rng.randrange(100, 40000) for _ in range(tail_len)] for _ in range(num_requests)]
    return Workload([prefix + t for t in tails], [max_tokens] * num_requests)


def registered_after_step() -> AbstractContextManager:
    """The engine as before same-step sharing: blocks enter the prefix cache once computed."""
    from engine.kv_cache_manager import KVCacheManager

    original = KVCacheManager.cache_blocks
    return mock.patch.object(
        KVCacheManager,
        "cache_blocks",
        lambda self, request, _=None: original(self, request),
    )


def burst_mode(
    wl: Workload, caching: bool, patch: Callable[[], AbstractContextManager], threads: int
) -> Callable[[], Run]:
    """The whole burst through `generate`, from an empty prefix cache, inside `patch()`; counts
    the prompt tokens the scheduler had computed."""
    llm = make_llm(caching, threads)
    eng = llm.engine
    schedule = eng.scheduler.schedule

    def run() -> Run:
        computed = []

        def counting(*args, **kwargs):
            out = schedule(*args, **kwargs)
            computed.append(sum(out.num_new_tokens))
            return out

        eng.kv.pool.reset_prefix_cache()
        with patch(), mock.patch.object(eng.scheduler, "schedule", counting):
            t0 = time.perf_counter()
            outs = llm.generate(wl.prompts, params(wl.out_lens[0]), use_tqdm=False)
            seconds = time.perf_counter() - t0
        # Every scheduled token is a prompt token except each request's decodes: its output
        # length less the first token, which the last prompt chunk produces.
        prompt_computed = sum(computed) - wl.num_output_tokens + len(wl.prompts)
        info = {"prompt_computed": prompt_computed}
        return Run({"seconds": seconds}, [o.outputs[0].token_ids for o in outs], info)

    return run


def measure_burst(wl: Workload, threads: int, repeats: int) -> dict[str, Timings]:
    torch.set_num_threads(threads)
    modes = {
        "tandem": burst_mode(wl, True, nullcontext, threads),
        "tandem_after_step": burst_mode(wl, True, registered_after_step, threads),
        "tandem_no_cache": burst_mode(wl, False, nullcontext, threads),
        "hf_static": hf_static_mode(load_hf_model(), wl, batch_size=len(wl.prompts)),
    }
    return alternate(modes, repeats, threads=threads)


# ---- main ------------------------------------------------------------------------------------


def run_cached(args, threads: int) -> tuple[bool, str | None]:
    """Every prefix length at `threads`: (failed, the first length's cold/cached TTFT ratio)."""
    failed, ratio = False, None
    for prefix_len in map(int, args.prefix_lens.split(",")):
        t = measure_cached(prefix_len, threads, args.tail, args.max_tokens, args.repeats)
        print(f"-- one request: {prefix_len} shared + {args.tail} own tokens, {threads} thread(s)")
        print("time to first token\n" + summary(t, "ttft", 1e3, "ms"))
        print("total\n" + summary(t, "total", 1e3, "ms"))
        print(f"prompt tokens computed: cold {t['cold'].info['computed_tokens']}, ", end="")
        print(f"cached {t['cached'].info['computed_tokens']}")
        for problem in cached_problems(t):
            print(f"MISMATCH {problem}")
            failed = True
        ratio = ratio or f"{t['cold'].median('ttft') / t['cached'].median('ttft'):.2f}"
    return failed, ratio


def run_burst(args, threads: int) -> tuple[bool, str]:
    """The burst at `threads`: (failed, its RESULT fields)."""
    wl = burst(args.requests, args.prefix, args.tail, args.max_tokens)
    t = measure_burst(wl, threads, args.repeats)
    print(
        f"-- burst: {args.requests} requests x ({args.prefix} shared + {args.tail}) tokens, ",
        end="",
    )
    print(f"{args.max_tokens} new each, {threads} thread(s)")
    print(summary(t, "seconds"))
    for name in ["tandem", "tandem_after_step", "tandem_no_cache"]:
        print(f"{name:<18} prompt tokens computed {t[name].info['prompt_computed']}")
    print(f"{'hf_static':<18} prompt tokens computed {wl.num_prompt_tokens}")
    diffs = unequal(t, "hf_static", ["tandem", "tandem_after_step", "tandem_no_cache"])
    for name, where in diffs.items():
        print(f"MISMATCH {name} against hf_static: {where}")
    print("token ids equal to HF's" if not diffs else "token ids differ from HF's")

    def x(other: str) -> str:
        return f"{t[other].median('seconds') / t['tandem'].median('seconds'):.2f}"

    fields = f"same_step_x_after_step={x('tandem_after_step')} "
    fields += f"same_step_x_no_cache={x('tandem_no_cache')} x_hf_static={x('hf_static')}"
    return bool(diffs), fields


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix-lens", default="512,1024,2048", help="one request: shared prefixes")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=384, help="the burst's shared prefix")
    ap.add_argument("--tail", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--burst", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args(argv)
    print(f"# {MODEL} fp32, greedy, EOS ignored, {args.repeats} rounds after a warm-up")
    failed, ratio, fields = False, None, None
    for threads in map(int, args.threads.split(",")):
        bad, first = run_cached(args, threads)
        failed, ratio = failed or bad, ratio or first
        if args.burst:
            bad, burst_fields = run_burst(args, threads)
            failed, fields = failed or bad, fields or burst_fields
    print(f"RESULT cached_x_cold_ttft={ratio} {fields or ''}".rstrip())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
