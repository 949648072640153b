"""A burst of requests that share a long system prompt, all arriving at once.

    python -m bench.shared_prefix [--requests 16] [--prefix 384] [--tail 24] [--max-tokens 16]

SmolLM2-135M fp32, one thread, greedy, EOS ignored. Modes, in one run:
- tandem: prefix caching as it ships: blocks are registered in the prefix cache when a step
  allocates them, so requests admitted in the same step share what the first computes;
- tandem_after_step: blocks registered only once computed (the engine before same-step sharing):
  the burst's first step computes the prefix once per request that fits the token budget;
- tandem_no_cache: prefix caching off;
- hf_static: HF transformers `generate` over the whole burst as one left-padded batch.
Reports wall time, prompt tokens computed by the engine, and checks that every mode's tokens
equal HF's. Last line: RESULT same_step_x_after_step=.. same_step_x_no_cache=.. x_hf_static=..
"""

from __future__ import annotations

import argparse
import random
import time
from contextlib import nullcontext
from unittest import mock

import torch

from bench.hf_baselines import load_hf_model, run_hf_static
from bench.workload import MODEL, Workload
from engine import LLM, SamplingParams
from engine.kv_cache_manager import KVCacheManager


def burst(num_requests: int, prefix_len: int, tail_len: int, max_tokens: int) -> Workload:
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(prefix_len)]
    tails = [[rng.randrange(100, 40000) for _ in range(tail_len)] for _ in range(num_requests)]
    return Workload([prefix + t for t in tails], [max_tokens] * num_requests)


def registered_after_step():
    """The engine as before same-step sharing: blocks enter the prefix cache once computed."""
    original = KVCacheManager.cache_blocks
    return mock.patch.object(
        KVCacheManager,
        "cache_blocks",
        lambda self, request, _=None: original(self, request),
    )


def run_tandem(wl: Workload, caching: bool, patch) -> tuple[float, int, list[list[int]]]:
    llm = LLM(MODEL, quantization=None, enable_prefix_caching=caching, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=wl.out_lens[0], ignore_eos=True)
    llm.generate([[1, 2, 3]], params, use_tqdm=False)  # warm-up
    computed = []
    schedule = llm.engine.scheduler.schedule

    def counting():
        out = schedule()
        computed.append(sum(out.num_new_tokens))
        return out

    with patch, mock.patch.object(llm.engine.scheduler, "schedule", counting):
        t0 = time.perf_counter()
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    prompt_computed = sum(computed) - wl.num_output_tokens + len(wl.prompts)  # minus decodes
    return seconds, prompt_computed, [o.outputs[0].token_ids for o in outs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=384)
    ap.add_argument("--tail", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    wl = burst(args.requests, args.prefix, args.tail, args.max_tokens)
    print(
        f"# {args.requests} requests x ({args.prefix} shared + {args.tail}) prompt tokens, "
        f"{args.max_tokens} new each, {MODEL} fp32, 1 thread"
    )
    modes = {
        "tandem": (True, nullcontext()),
        "tandem_after_step": (True, registered_after_step()),
        "tandem_no_cache": (False, nullcontext()),
    }
    seconds, tokens = {}, {}
    for name, (caching, patch) in modes.items():
        seconds[name], computed, tokens[name] = run_tandem(wl, caching, patch)
        print(f"{name:<18} {seconds[name]:7.2f} s  prompt tokens computed {computed}")
    hf = run_hf_static(load_hf_model(), wl, batch_size=len(wl.prompts))
    seconds["hf_static"] = hf.seconds
    print(f"{'hf_static':<18} {hf.seconds:7.2f} s  prompt tokens computed {wl.num_prompt_tokens}")
    reference = [hf.outputs[i] for i in range(len(wl.prompts))]
    equal = {
        name: sum(a == b for a, b in zip(t, reference, strict=True)) for name, t in tokens.items()
    }
    print(f"token ids equal to HF's: {equal} of {len(reference)} each")
    base = seconds["tandem"]
    print(
        f"RESULT same_step_x_after_step={seconds['tandem_after_step'] / base:.2f} "
        f"same_step_x_no_cache={seconds['tandem_no_cache'] / base:.2f} "
        f"x_hf_static={seconds['hf_static'] / base:.2f}"
    )
    return 0 if all(n == len(reference) for n in equal.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
