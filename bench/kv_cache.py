"""Batch-1 decode at long context with the KV cache in float32 (the default) and in int8
(EngineConfig.kv_cache_dtype, engine.models.kv_cache), the GGUF's own blocks on the C++ layers.

    python -m bench.kv_cache [--model smollm2-135m-instruct] [--context 2048] [--tokens 64]
                             [--threads 1] [--repeats 3]

One request at a time, greedy, EOS ignored, prefix caching off; the prompt is real English text
(bench/quality.py) of --context tokens. The two modes alternate (bench/harness.py: a warm-up
each, then --repeats rounds, median and spread); the machine's load average is printed with
each figure. Per token: from the first to the last token. Last line: RESULT int8_x_float32=..
(the per-token speed ratio, > 1 when the int8 cache decodes faster) and the bytes per token.
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse

from bench.decode import engine_mode
from bench.harness import alternate, summary
from bench.quality import held_tokens

MODES = {"float32": "auto", "int8": "int8"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from engine import LLM

    llms = {
        name: LLM(
            args.model,
            num_threads=args.threads,
            enable_prefix_caching=False,
            max_model_len=args.context + args.tokens + 1,
            kv_cache_dtype=dtype,
        )
        for name, dtype in MODES.items()
    }
    prompt = held_tokens(llms["float32"].engine.tokenizer, args.context)
    modes = {name: engine_mode(llm, prompt, args.tokens) for name, llm in llms.items()}
    timings = alternate(modes, args.repeats, threads=args.threads)
    print(f"-- {args.model}: prompt {args.context} tokens, {args.threads} thread(s)")
    print("time to first token\n" + summary(timings, "ttft", 1e3, "ms"))
    print("per token\n" + summary(timings, "per_token", 1e3, "ms"))
    per_token = {n: llm.engine.snapshot()["kv_bytes_per_token"] for n, llm in llms.items()}
    ratio = timings["float32"].median("per_token") / timings["int8"].median("per_token")
    print(
        f"RESULT int8_x_float32={ratio:.2f} kv_bytes_per_token float32={per_token['float32']:.0f}"
        f" int8={per_token['int8']:.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
