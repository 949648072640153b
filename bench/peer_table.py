"""Every installed embedded model against llama.cpp on the same GGUF (`python -m bench.peers
--table`): batch-1 decode and prompt processing at 1 and 2 threads, the decode's weight traffic
against the machine's read bandwidth, and resident memory against the file.

- decode: tok/s over 128 new tokens after a chat prompt (the engine: from its first to its last
  streamed token; llama.cpp: llama-bench's tg128);
- prompt: tok/s of a 512-token prompt (the engine: `generate` with max_tokens=1, so one LM head
  row and a sample beside the prompt; llama.cpp: llama-bench's pp512);
- GB/s: the engine's resident weight bytes read per decoded token (every projection's codes,
  scales and offsets and the LM head; embedding rows are read a few at a time) times its
  decode rate, beside what one `sum` over 1 GiB of float32 (in huge pages, as the weights) reads
  per second on as many threads;
- memory: what loading adds to a fresh process's memory after its libraries and tokenizer:
  private (anonymous) pages, and in brackets all of RSS (which also counts the pages of torch's
  code the load runs for the first time, shared with other processes).
Sides alternate, a warm-up each, median (min-max) of --repeats; prefix caching off.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from bench.peers import CHATS, _run, engine_decode, load_rss, spread

PROMPT_TOKENS = 512


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """GB/s that torch's sum reads from a 1 GiB float32 tensor on `threads` threads, in huge
    pages where the OS gives them (as the engine's weights: engine.models.huge_pages; from 4 KiB
    pages the same sum reads ~20% less on the Xeon VM)."""
    from engine.models import huge_pages

    torch.set_num_threads(threads)
    x = huge_pages.zeros(1 << 28, dtype=torch.float32).fill_(1.0)
    x.sum()
    start = time.perf_counter()
    for _ in range(repeats):
        x.sum()
    return x.numel() * 4 * repeats / (time.perf_counter() - start) / 1e9


def weight_bytes(model) -> int:
    """Bytes of every weight format's tensors (shared ones once): what a decode step reads."""
    from engine.models.huge_pages import module_tensors

    seen, total = set(), 0
    for t in module_tensors(model):  # parameters, and tensors in attributes (segments too)
        key = t.untyped_storage().data_ptr()
        if t.layout == torch.strided and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def decode_prompt(llm) -> list[int]:
    """A chat prompt, or the text itself for a model without a chat template (Gemma 3 270M)."""
    if llm.tokenizer.chat_template:
        return llm.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    return llm.tokenizer.encode(CHATS[0])


def engine_prompt(llm, prompt: list[int]) -> float:
    from engine import SamplingParams

    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return len(prompt) / (time.perf_counter() - start)


def llama_bench(bin_dir: Path, gguf: Path, threads: int) -> tuple[float, float]:
    """llama-bench's (tg128, pp512) tok/s."""
    args = ("-m", gguf, "-p", PROMPT_TOKENS, "-n", 128, "-t", threads, "-r", 1, "-o", "json")
    rows = json.loads(_run(bin_dir, "llama-bench", *args))
    rate = {(r["n_prompt"], r["n_gen"]): float(r["avg_ts"]) for r in rows}
    return rate[(0, 128)], rate[(PROMPT_TOKENS, 0)]


def model_rows(name: str, gguf: Path, bin_dir: Path | None, repeats: int) -> list[dict]:
    from engine import LLM

    rows = []
    for threads in (1, 2):
        llm = LLM(name, num_threads=threads, enable_prefix_caching=False)
        chat = decode_prompt(llm)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(100, 20000, (PROMPT_TOKENS,), generator=g).tolist()
        got = {"decode": [], "prompt": [], "llama_decode": [], "llama_prompt": []}
        engine_decode(llm, chat), engine_prompt(llm, prompt)  # warm-ups, alike on both sides
        if bin_dir:
            llama_bench(bin_dir, gguf, threads)
        for _ in range(repeats):
            got["decode"].append(engine_decode(llm, chat)[0])
            if bin_dir:
                decode, prompt_rate = llama_bench(bin_dir, gguf, threads)
                got["llama_decode"].append(decode)
                got["llama_prompt"].append(prompt_rate)
            got["prompt"].append(engine_prompt(llm, prompt))
        rows.append({"threads": threads, "bytes": weight_bytes(llm.engine.runner.model), **got})
        del llm
    return rows


SIDES = ("decode", "llama_decode", "prompt", "llama_prompt")


def table_line(name: str, size: int, row: dict, bandwidth: float, memory: dict) -> str:
    cells = {}
    for side in ("decode", "prompt"):
        cells[side] = spread(row[side])
        if row[f"llama_{side}"]:
            ratio = statistics.median(row[side]) / statistics.median(row[f"llama_{side}"])
            cells[side] += f" / {spread(row[f'llama_{side}'])} = **{ratio:.2f}x**"
    gbs = row["bytes"] * statistics.median(row["decode"]) / 1e9
    return (
        f"| {name} ({size / 1e6:.0f} MB) | {row['threads']} | {cells['decode']} | "
        f"{cells['prompt']} | {gbs:.1f} ({gbs / bandwidth:.0%}) | "
        f"{memory['private'] / size:.2f}x ({memory['rss'] / size:.2f}x) |"
    )


def print_table(
    bin_dir: Path | None, repeats: int, models: list[str] | None = None
) -> dict[str, float]:
    from engine.models.loader import gguf_file
    from engine.models.registry import EMBEDDED_MODELS, ModelNotFoundError, resolve_model

    bandwidth = {t: read_bandwidth(t) for t in (1, 2)}
    print(f"read bandwidth (torch sum over 1 GiB): {bandwidth[1]:.1f} GB/s on 1 thread, "
          f"{bandwidth[2]:.1f} on 2")  # fmt: skip
    print("| model (GGUF) | threads | decode tok/s: engine / llama.cpp | prompt 512 tok/s: "
          "engine / llama.cpp | decode GB/s (of bandwidth) | load memory / file: "
          "private (RSS) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    result = {}
    for name in models or EMBEDDED_MODELS:
        try:
            gguf = gguf_file(resolve_model(name, dense=False))
        except ModelNotFoundError:
            print(f"| {name} | not installed: {EMBEDDED_MODELS[name].pip_command} |")
            continue
        size = gguf.stat().st_size
        memory = load_rss(name, "auto")
        short = name.split("-instruct")[0]
        result[f"{short}_rss_x_file"] = memory["rss"] / size
        result[f"{short}_private_x_file"] = memory["private"] / size
        for row in model_rows(name, gguf, bin_dir, repeats):
            print(table_line(name, size, row, bandwidth[row["threads"]], memory), flush=True)
            if bin_dir:
                med = {k: statistics.median(row[k]) for k in SIDES}
                t = row["threads"]
                result[f"{short}_decode_x_llamacpp_t{t}"] = med["decode"] / med["llama_decode"]
                result[f"{short}_prompt_x_llamacpp_t{t}"] = med["prompt"] / med["llama_prompt"]
    return result
