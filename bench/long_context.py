"""Long contexts against llama.cpp on the same GGUF: a prompt chunk, a decode token and a
verification step at a depth of D tokens already in the cache.

    python -m bench.long_context [--model qwen2.5-coder-0.5b-instruct] [--depths 0,1024,3008]
                                 [--threads 1,2] [--repeats 2] [--llama-cpp DIR]
                                 [--verify-rows 16]

At each depth D (a multiple of the block size, so that exactly D are cached; real English
text, bench/quality.py's; the engine's default GGUF path):
- prompt: 512 more tokens after D cached ones (prefix caching on, the D tokens cached by a first
  request): 512 / seconds; llama.cpp: `llama-bench -p 512 -d D` (pp512 @ dD);
- decode: 64 greedy tokens (EOS ignored) after a prompt of D + 1 tokens, the first D cached:
  per token after the first; llama.cpp: `llama-bench -n 64 -d D` (tg64 @ dD);
- verify: R more tokens after D cached ones (R = 16: the rows a proposer's 15-token draft is
  verified in, 32 a prediction's 31; one logits row as here), milliseconds, for each R of
  --verify-rows; no llama.cpp counterpart.
Sides alternated per round, a warm-up round first; median (min-max) of --repeats.
Last line: RESULT prompt_x_llamacpp_t{T}_d{D}=.. decode_x_llamacpp_t{T}_d{D}=..
verify{R}_ms_t{T}_d{D}=..
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from bench.decode import llama_cpp_dir
from bench.harness import load_average

CHUNK, NEW = 512, 64


def engine_side(llm, ids: list[int], depth: int, verify_rows: list[int]) -> dict[str, float]:
    from engine import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1)
    base = {"prompt_token_ids": ids[:depth]} if depth else None

    def timed(n: int, params) -> tuple[float, list[float]]:
        llm.engine.scheduler.kv.pool.reset_prefix_cache()  # nothing of the last run reused
        if base:
            llm.generate(base, one, use_tqdm=False)  # the depth cached (again, if evicted)
        stamps, start = [], time.perf_counter()
        for out in llm.stream({"prompt_token_ids": ids[: depth + n]}, params):
            if out.outputs[0].token_ids:
                stamps.append(time.perf_counter())
        return stamps[0] - start, stamps

    prompt_s, _ = timed(CHUNK, one)
    verify = {f"verify{n}_ms": timed(n, one)[0] * 1e3 for n in verify_rows}
    _, stamps = timed(1, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    per_token = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    return {"prompt": CHUNK / prompt_s, "decode": 1 / per_token} | verify


def llama_side(bin_dir: Path, gguf: Path, threads: int, depth: int) -> dict[str, float]:
    command = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-d", str(depth)]
    command += ["-p", str(CHUNK), "-n", str(NEW), "-r", "1", "-o", "json"]
    rows = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    rate = {(r["n_prompt"], r["n_gen"]): float(r["avg_ts"]) for r in rows}
    return {"llama_prompt": rate[(CHUNK, 0)], "llama_decode": rate[(0, NEW)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--depths", default="0,1024,3008")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--llama-cpp", default=None)
    ap.add_argument("--verify-rows", default="16")
    args = ap.parse_args(argv)
    from bench.quality import held_text
    from engine import LLM
    from engine.models.registry import resolve_model

    bin_dir = llama_cpp_dir(args.llama_cpp)
    if bin_dir is None:
        print("llama.cpp: no binaries (--llama-cpp DIR or TANDEM_LLAMA_CPP): its side skipped")
    gguf = next(resolve_model(args.model).glob("*.gguf"))
    depths = [int(d) for d in args.depths.split(",")]
    verify_rows = [int(n) for n in args.verify_rows.split(",")]
    result = {}
    for threads in map(int, args.threads.split(",")):
        llm = LLM(args.model, num_threads=threads, max_model_len=max(depths) + 1024)
        ids = llm.tokenizer(held_text(), add_special_tokens=False).input_ids
        for depth in depths:
            got: dict[str, list[float]] = {}
            for r in range(args.repeats + 1):  # round 0 warms both sides up
                sides = engine_side(llm, ids, depth, verify_rows)
                if bin_dir:
                    sides |= llama_side(bin_dir, gguf, threads, depth)
                for k, v in sides.items():
                    got.setdefault(k, []).extend([v] if r else [])
            med = {k: statistics.median(v) for k, v in got.items()}
            span = {k: f"{min(v):.1f}-{max(v):.1f}" for k, v in got.items()}
            line = f"{threads} thread(s), depth {depth}: " + ", ".join(
                f"{k} {med[k]:.1f} ({span[k]})" for k in med
            )
            print(line + f"; load {load_average():.1f}", flush=True)
            for n in verify_rows:
                result[f"verify{n}_ms_t{threads}_d{depth}"] = f"{med[f'verify{n}_ms']:.1f}"
            if bin_dir:
                for k in ("prompt", "decode"):
                    result[f"{k}_x_llamacpp_t{threads}_d{depth}"] = (
                        f"{med[k] / med['llama_' + k]:.2f}"
                    )
        del llm
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
