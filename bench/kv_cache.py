"""Batch-1 decode at long context with the KV cache in float32 (the default), in int8 and
(--modes) in bfloat16 (EngineConfig.kv_cache_dtype, engine.models.kv_cache), the GGUF's own
blocks on the C++ layers.

    python -m bench.kv_cache [--model smollm2-135m-instruct] [--context 2048] [--tokens 64]
                             [--threads 1] [--repeats 3] [--modes float32,int8,bfloat16]

One request at a time, greedy, EOS ignored, prefix caching off; the prompt is real English text
(bench/quality.py) of --context tokens. The modes alternate (bench/harness.py: a warm-up each,
then --repeats rounds, median and spread); the machine's load average is printed with each
figure. Per token: from the first to the last token. Then, as a whole run's decode is long
enough for a shared machine's load to come and go within it, the modes decode in turn: each
mode's request is prefilled once, then --rounds times every mode decodes --burst tokens (the
order reversed every other round), each burst one figure (median and spread over the rounds).
Last line: RESULT int8_x_float32=.. (the interleaved per-token speed ratio, > 1 when the int8
cache decodes faster; likewise bfloat16_x_float32) and the bytes per token.
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import time

import torch

from bench.decode import engine_mode
from bench.harness import Run, Timings, alternate, load_average, summary
from bench.quality import held_tokens

MODES = {"float32": "auto", "int8": "int8", "bfloat16": "bfloat16"}


def interleaved_decode(
    llms: dict, prompt: list[int], rounds: int, burst: int, threads: int
) -> dict[str, Timings]:
    """Seconds per token of `burst`-token stretches of one long decode per mode, in turn."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1 + rounds * burst, ignore_eos=True)
    names = list(llms)
    streams = {name: llm.stream(prompt, params) for name, llm in llms.items()}
    timings = {name: Timings(name) for name in names}
    for name in names:  # the prompt and the first token
        torch.set_num_threads(threads)
        next(streams[name])
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else reversed(names):
            torch.set_num_threads(threads)
            timings[name].loads.append(load_average())
            start, tokens = time.perf_counter(), 0
            while tokens < burst:
                tokens += len(next(streams[name]).outputs[0].token_ids)
            timings[name].runs.append(Run({"per_token": (time.perf_counter() - start) / tokens}))
    for stream in streams.values():
        for _ in stream:  # (the request ends with its last token)
            pass
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="float32,int8", help="of " + ",".join(MODES))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--burst", type=int, default=16)
    args = parser.parse_args(argv)
    names = args.modes.split(",")
    if names[0] != "float32" or not set(names) <= set(MODES):
        parser.error(f"--modes: float32 first, then any of {list(MODES)[1:]}")
    from engine import LLM

    llms = {
        name: LLM(
            args.model,
            num_threads=args.threads,
            enable_prefix_caching=False,
            max_model_len=args.context + max(args.tokens, args.rounds * args.burst) + 1,
            kv_cache_dtype=dtype,
        )
        for name, dtype in MODES.items()
        if name in names
    }
    prompt = held_tokens(llms["float32"].engine.tokenizer, args.context)
    modes = {name: engine_mode(llm, prompt, args.tokens) for name, llm in llms.items()}
    timings = alternate(modes, args.repeats, threads=args.threads)
    print(f"-- {args.model}: prompt {args.context} tokens, {args.threads} thread(s)")
    print("time to first token\n" + summary(timings, "ttft", 1e3, "ms"))
    print("per token\n" + summary(timings, "per_token", 1e3, "ms"))
    timings = interleaved_decode(llms, prompt, args.rounds, args.burst, args.threads)
    print(f"per token, {args.rounds} rounds of {args.burst} tokens in turn")
    print(summary(timings, "per_token", 1e3, "ms"))
    per_token = {n: llm.engine.snapshot()["kv_bytes_per_token"] for n, llm in llms.items()}
    base = timings["float32"].median("per_token")
    ratios = " ".join(
        f"{n}_x_float32={base / timings[n].median('per_token'):.2f}" for n in names[1:]
    )
    sizes = " ".join(f"{n}={per_token[n]:.0f}" for n in names)
    print(f"RESULT {ratios} kv_bytes_per_token {sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
