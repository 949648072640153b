"""The engine with its defaults against llama.cpp on the same GGUF file, and exact self-speculation.

    python -m bench.peers --llama-cpp DIR   # DIR holds llama-bench and llama-batched-bench
    (or TANDEM_LLAMA_CPP=DIR; without them the llama.cpp sides are skipped, said so, and the
    RESULT line carries only the engine's own figures)

For each thread count (1 and 2), alternating the two sides, `--repeats` times each:
- decode: batch-1 greedy decode rate over 128 new tokens (the engine: from its first to its
  last streamed token; llama.cpp: `llama-bench -p 0 -n 128`, its tg128 rate);
- batch: 24 requests x (75 prompt + 38 new tokens) submitted at once, wall seconds (llama.cpp:
  `llama-batched-bench -npp 75 -ntg 38 -npl 24`, its total T s).
Then, on one thread, exact self-speculation (`draft_model="self"`: the GGUF's own blocks draft
for the fp32 weights) against plain fp32 decoding on open-ended chat prompts: the outputs must
be equal token for token (exit 1 otherwise). Last, resident memory: what loading the weights of
`--rss-model` (Qwen2.5-Coder-1.5B by default, SmolLM2 when it is not installed) adds to a fresh
process's RSS after its libraries and tokenizer, against the GGUF file's size.
Prefix caching is off everywhere. Medians with min-max spread; the CPU's name and flags lead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import Run, alternate

MODEL = "smollm2-135m-instruct"
CHATS = [
    "Tell me a story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how vaccines train the immune system.",
    "Write a letter to a friend about a trip to the mountains.",
]


def cpu_summary() -> str:
    import torch

    name, flags = "unknown", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        text = cpuinfo.read_text()
        name = re.search(r"model name\s*:\s*(.*)", text).group(1).strip()
        flags = set(re.search(r"flags\s*:\s*(.*)", text).group(1).split())
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    have = ",".join(f for f in wanted if f in flags)
    return f"{name} [{have}] torch capability {torch.backends.cpu.get_cpu_capability()}"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


# ---- llama.cpp --------------------------------------------------------------------------------
# where `make llama-server` builds llama.cpp's tools
LLAMA_CPP_BUILD = Path(__file__).resolve().parents[1] / ".llama.cpp" / "build" / "bin"


def llama_cpp_dir(
    arg: str | None, tools: tuple[str, ...] = ("llama-bench", "llama-batched-bench")
) -> Path | None:
    """The folder with llama.cpp's `tools`: `arg`, else $TANDEM_LLAMA_CPP, else
    LLAMA_CPP_BUILD; None when it lacks one of them."""
    d = Path(arg or os.environ.get("TANDEM_LLAMA_CPP") or LLAMA_CPP_BUILD)
    return d if all((d / tool).is_file() for tool in tools) else None


def _run(bin_dir: Path, tool: str, *args) -> str:
    command = [str(bin_dir / tool), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def llama_decode(bin_dir: Path, gguf: Path, threads: int) -> float:
    args = ("-m", gguf, "-p", 0, "-n", 128, "-t", threads, "-r", 1, "-o", "json")
    return float(json.loads(_run(bin_dir, "llama-bench", *args))[0]["avg_ts"])


def llama_batch(bin_dir: Path, gguf: Path, threads: int) -> float:
    args = ("-m", gguf, "-c", 4096, "-b", 2048, "-ub", 512, "-npp", 75, "-ntg", 38, "-npl", 24)
    out = _run(bin_dir, "llama-batched-bench", *args, "-t", threads, "-tb", threads)
    row = [line for line in out.splitlines() if re.match(r"\|\s+75\s+\|\s+38\s+\|\s+24\s+\|", line)]
    return float(row[0].split("|")[9])  # T s: prompt processing and generation together


# ---- the engine -------------------------------------------------------------------------------
def engine_decode(llm, prompt: list[int]) -> tuple[float, list[int]]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    stamps, ids = [], []
    for delta in llm.stream(prompt, params):
        stamps.append(time.perf_counter())
        ids += delta.outputs[0].token_ids
    assert len(ids) == 128, len(ids)
    # tokens after the first, over the time they took (speculation emits several at once)
    return (len(ids) - 1) / (stamps[-1] - stamps[0]), ids


def engine_batch(llm, prompts: list[list[int]]) -> Run:
    """All prompts at once, 38 new tokens each: wall seconds and every request's token ids."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=38, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    ids = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == 38 for t in ids)
    return Run({"seconds": seconds}, ids, {"tokens": 38 * len(prompts)})


def batch_measure(threads: int, repeats: int, bin_dir: Path, gguf: Path):
    """The engine's 24 x (75 + 38) batch against llama-batched-bench's, alternated (the suite's
    llama.cpp batch group). Also each request run alone on the engine, untimed: a row's tokens
    must not depend on what shares its step (the GGUF path's row invariance)."""
    llm = make_llm(threads)
    prompts = batch_prompts(llm)

    def llama() -> Run:
        return Run({"seconds": llama_batch(bin_dir, gguf, threads)}, None, {"tokens": 38 * 24})

    modes = {"engine": lambda: engine_batch(llm, prompts), "llama.cpp": llama}
    timings = alternate(modes, repeats, threads=threads)
    alone = [engine_batch(llm, [p]).outputs[0] for p in prompts]
    return timings, alone


def make_llm(threads: int, **kwargs):
    from engine import LLM

    return LLM(MODEL, num_threads=threads, enable_prefix_caching=False, **kwargs)


def batch_prompts(llm) -> list[list[int]]:
    from bench.quality import held_tokens

    ids = held_tokens(llm.engine.tokenizer, 24 * 75)
    return [ids[i * 75 : (i + 1) * 75] for i in range(24)]


def peer_rounds(threads: int, repeats: int, bin_dir: Path | None, gguf: Path) -> dict:
    llm = make_llm(threads)
    chat = llm.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    prompts = batch_prompts(llm)
    engine_decode(llm, chat), engine_batch(llm, prompts[:4])  # warm-up, alike on both sides
    if bin_dir:
        llama_decode(bin_dir, gguf, threads)
    got = {"decode": [], "batch": [], "llama_decode": [], "llama_batch": []}
    for _ in range(repeats):
        got["decode"].append(engine_decode(llm, chat)[0])
        if bin_dir:
            got["llama_decode"].append(llama_decode(bin_dir, gguf, threads))
        got["batch"].append(engine_batch(llm, prompts).metrics["seconds"])
        if bin_dir:
            got["llama_batch"].append(llama_batch(bin_dir, gguf, threads))
    return got


def self_speculation(repeats: int) -> tuple[float, float, list[float], bool]:
    """Decode rates of plain fp32 and of draft_model="self", alternated; outputs compared."""
    plain = make_llm(1, quantization=None)
    spec = make_llm(1, draft_model="self")
    prompts = [plain.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    rates = {"plain": [], "self": []}
    equal = True
    engine_decode(plain, prompts[0]), engine_decode(spec, prompts[0])
    for _ in range(repeats):
        for prompt in prompts:
            a, ids_plain = engine_decode(plain, prompt)
            b, ids_spec = engine_decode(spec, prompt)
            rates["plain"].append(a)
            rates["self"].append(b)
            equal &= ids_plain == ids_spec
    by_position = spec.engine.speculation.stats.acceptance_by_position
    return statistics.median(rates["plain"]), statistics.median(rates["self"]), by_position, equal


RSS_PROBE = """
import json, sys, psutil, torch
from transformers import AutoConfig, AutoTokenizer
from engine.models.loader import load_model, release_freed_memory
from engine.models.registry import resolve_model
torch.set_num_threads(1)
path = resolve_model(sys.argv[1], dense=sys.argv[2] == "none")
AutoTokenizer.from_pretrained(str(path)), AutoConfig.from_pretrained(str(path))
release_freed_memory()  # (else the tokenizer's freed pages, trimmed by the load, count against it)
before = psutil.Process().memory_info()
model = load_model(path, quantization=None if sys.argv[2] == "none" else sys.argv[2])
after = psutil.Process().memory_info()
rss = after.rss - before.rss
private = rss - (after.shared - before.shared)  # less the mapped files' pages: anonymous ones
print(json.dumps({"rss": rss, "private": private}))
"""


def load_rss(model: str, quantization: str) -> dict[str, int]:
    """What loading the model's weights adds to a process's memory, in a fresh process whose
    libraries and tokenizer are loaded first: "rss", all resident pages, and "private", its
    anonymous ones (what the load allocates: on every CPU path the weights are copied out of the
    file), which leave out mapped files' pages: torch's code the load runs for the first time
    (about 10 MB, shared with every other torch process and touched by any first request
    anyway), and a checkpoint file still mapped after the load (the dense path's safetensors)."""
    out = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, model, quantization],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def rss_model(name: str) -> str:
    """The model whose memory is reported: `name` if its weights are installed, else SmolLM2."""
    from engine.models.registry import ModelNotFoundError, resolve_model

    try:
        resolve_model(name, dense=False)
    except ModelNotFoundError as e:
        print(f"memory: {e}; measuring {MODEL} instead")
        return MODEL
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", help="directory with llama-bench and llama-batched-bench")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--rss-model",
        default="qwen2.5-coder-1.5b-instruct",
        help="model whose resident memory after load is measured (SmolLM2 when not installed)",
    )
    ap.add_argument(
        "--table",
        action="store_true",
        help="only the per-model table: decode and prompt against llama.cpp, 1 and 2 threads, "
        "bandwidth, memory (bench/peer_table.py)",
    )
    ap.add_argument("--models", help="with --table: these embedded models (comma-separated)")
    args = ap.parse_args(argv)
    from engine.models.loader import gguf_file
    from engine.models.registry import resolve_model

    gguf = gguf_file(resolve_model(MODEL, dense=False))
    bin_dir = llama_cpp_dir(args.llama_cpp)
    if args.table:
        from bench.peer_table import print_table

        print(f"CPU: {cpu_summary()}")
        models = args.models.split(",") if args.models else None
        result = print_table(bin_dir, args.repeats, models)
        print("RESULT " + " ".join(f"{k}={v:.2f}" for k, v in result.items()))
        return 0
    print(f"CPU: {cpu_summary()}")
    print(f"model {MODEL}: {gguf.name} ({gguf.stat().st_size / 1e6:.1f} MB)")
    if bin_dir is None:
        print(
            "llama.cpp: no llama-bench / llama-batched-bench (--llama-cpp DIR or "
            "TANDEM_LLAMA_CPP): its sides are skipped"
        )
    result = {}
    for threads in (1, 2):
        got = peer_rounds(threads, args.repeats, bin_dir, gguf)
        print(
            f"[{threads} thread(s)] decode tok/s: engine {spread(got['decode'])}"
            + (f", llama.cpp {spread(got['llama_decode'])}" if bin_dir else "")
        )
        print(
            f"[{threads} thread(s)] 24 x (75 + 38) s: engine {spread(got['batch'])}"
            + (f", llama.cpp {spread(got['llama_batch'])}" if bin_dir else "")
        )
        result[f"decode_tok_s_t{threads}"] = statistics.median(got["decode"])
        if bin_dir:
            med = {k: statistics.median(v) for k, v in got.items()}
            result[f"decode_x_llamacpp_t{threads}"] = med["decode"] / med["llama_decode"]
            result[f"batch_x_llamacpp_t{threads}"] = med["llama_batch"] / med["batch"]
    plain, selfspec, by_position, equal = self_speculation(args.repeats)
    print(
        f"[1 thread] fp32 decode {plain:.2f} tok/s, draft_model='self' {selfspec:.2f} tok/s; "
        f"acceptance by position {[round(a, 3) for a in by_position]}; outputs equal: {equal}"
    )
    result["selfspec_speedup"] = selfspec / plain
    memory_model = rss_model(args.rss_model)
    model_gguf = gguf_file(resolve_model(memory_model, dense=False))
    size = model_gguf.stat().st_size
    for quantization in ("auto", "none"):
        memory = load_rss(memory_model, quantization)
        rss, private = memory["rss"], memory["private"]
        print(
            f"load RSS {memory_model} quantization={quantization}: {rss / 1e6:.0f} MB "
            f"(x{rss / size:.2f} the GGUF file), private {private / 1e6:.0f} MB "
            f"(x{private / size:.2f})"
        )
        if quantization == "auto":
            result["rss_x_gguf"] = rss / size
            result["private_x_gguf"] = private / size
    print("RESULT " + " ".join(f"{k}={v:.2f}" for k, v in result.items()))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
