"""Perplexity against llama.cpp's `llama-perplexity` on the same tokens and the same GGUF.

    python -m bench.perplexity --model gemma3-270m --llama-cpp DIR [--ctx 128] [--chars 40000]
    (DIR holds llama-perplexity and llama-tokenize; TANDEM_LLAMA_CPP works too)

The text is real English (CPython's documentation topics, bench/quality.py), cut to --chars.
llama.cpp tokenizes it (`llama-tokenize --ids`: its tokenizer and HF's split some whitespace
differently, so both sides score llama.cpp's ids) and `llama-perplexity -c CTX` scores it: in
each chunk of CTX tokens, the first replaced by BOS where the model adds one, the tokens of the
second half, each given everything before it in the chunk. The engine scores the same chunks
the same way through its prompt logprobs, with its defaults (the GGUF's own blocks on CPU) and
with `--quantization none` as well when asked. Exit 1 when the engine's perplexity is not
within 1% of llama.cpp's. Last line: RESULT ppl_engine=.. ppl_llama_cpp=.. ratio=..
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

MAX_RATIO = 1.01


def llama_cpp(bin_dir: Path, tool: str, *args) -> str:
    done = subprocess.run([str(bin_dir / tool), *map(str, args)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{tool} failed: {done.stderr[-2000:]}")
    return done.stdout + done.stderr


def llama_ids(bin_dir: Path, gguf: Path, text_file: Path) -> list[int]:
    out = llama_cpp(
        bin_dir, "llama-tokenize", "-m", gguf, "-f", text_file, "--ids", "--log-disable"
    )
    return ast.literal_eval(re.findall(r"\[[\d, ]+\]", out)[-1])


def llama_perplexity(bin_dir: Path, gguf: Path, text_file: Path, ctx: int) -> float:
    out = llama_cpp(bin_dir, "llama-perplexity", "-m", gguf, "-f", text_file, "-c", ctx, "-t", 2)
    return float(re.search(r"Final estimate: PPL = ([\d.]+)", out).group(1))


def engine_perplexity(llm, ids: list[int], ctx: int, bos: int | None) -> float:
    """llama-perplexity's scoring: the second half of each whole chunk of ctx tokens."""
    from engine import SamplingParams

    chunks = [ids[i * ctx : (i + 1) * ctx] for i in range(len(ids) // ctx)]
    if bos is not None:
        chunks = [[bos, *c[1:]] for c in chunks]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    first, nll, count = ctx // 2, 0.0, 0
    for chunk, out in zip(chunks, llm.generate(chunks, params, use_tqdm=False), strict=True):
        for k in range(first + 1, ctx):
            nll -= out.prompt_logprobs[k][chunk[k]].logprob
            count += 1
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> int:
    from bench.quality import held_text
    from engine import LLM
    from engine.models.loader import gguf_file
    from engine.models.registry import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--llama-cpp", default=os.environ.get("TANDEM_LLAMA_CPP"))
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--chars", type=int, default=40000)
    ap.add_argument("--quantization", default="auto", help="the engine's ('none': float32)")
    args = ap.parse_args(argv)
    bin_dir = Path(args.llama_cpp) if args.llama_cpp else None
    if bin_dir is None or not (bin_dir / "llama-perplexity").is_file():
        print("no llama-perplexity (--llama-cpp DIR or TANDEM_LLAMA_CPP): nothing to compare")
        return 0
    gguf = gguf_file(resolve_model(args.model, dense=args.quantization == "none"))
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        text.write_text(held_text()[: args.chars])
        ids = llama_ids(bin_dir, gguf, text)
        theirs = llama_perplexity(bin_dir, gguf, text, args.ctx)
    quantization = None if args.quantization == "none" else args.quantization
    llm = LLM(args.model, quantization=quantization, enable_prefix_caching=False)
    bos = llm.tokenizer.bos_token_id if ids and ids[0] == llm.tokenizer.bos_token_id else None
    ours = engine_perplexity(llm, ids, args.ctx, bos)
    print(f"{args.model}: {len(ids)} tokens, chunks of {args.ctx}; perplexity: engine "
          f"({args.quantization}) {ours:.4f}, llama.cpp {theirs:.4f}")  # fmt: skip
    ratio = ours / theirs
    print(f"RESULT ppl_engine={ours:.4f} ppl_llama_cpp={theirs:.4f} ratio={ratio:.4f}")
    return 0 if max(ratio, 1 / ratio) <= MAX_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
