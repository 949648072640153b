"""Batch-1 latency: time to first token and time per output token, every way of running SmolLM2.

    python -m bench.decode [--prompt-lens 64,512,2048] [--threads 1,2] [--tokens 64]
                           [--repeats 3] [--llama-cpp DIR]

One request at a time, greedy, EOS ignored, prefix caching off; the prompt is real English text
(CPython's documentation topics, bench/quality.py) cut to the prompt length. Modes, alternated
(bench/harness.py: a warm-up each, then --repeats rounds, median and spread):
- fp32: the engine on the exact dense weights (`quantization=None`);
- gguf: the engine on the GGUF's own 4-bit blocks (the default on CPU);
- fp32+ngram / fp32+self: the exact weights with n-gram prompt lookup / with the GGUF's blocks
  drafting for them (`draft_model="self"`), adaptive k;
- hf: HF transformers `generate` at its fastest setting measured on this CPU
  (bench/hf_baselines.py's HF_FASTEST; the suite's `hf-settings` group measures eager / sdpa
  attention x dynamic / static cache);
- llama.cpp: `llama-bench` on the same GGUF (pp rate for the prompt, tg rate at that depth), when
  its binaries are given (--llama-cpp or TANDEM_LLAMA_CPP); its tokens are not visible to us.
fp32, fp32+ngram, fp32+self and hf must produce the same token ids (exit 1 otherwise); gguf is
approximate and must meet the quality rule of bench/quality.py against fp32.
Time to first token: from submitting the request to its first token. Per token: from the first
to the last token over the tokens after the first delta (speculation emits several at once).
Last line: RESULT gguf_x_fp32=.. gguf_x_hf=.. gguf_x_llama_cpp=.. self_x_fp32=.. (per-token
speed ratios at the first prompt length and thread count, > 1 when the first is faster)
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.harness import Run, Timings, alternate, summary, unequal
from bench.hf_baselines import HF_FASTEST, generate, load_hf_model
from bench.speculative import counters
from bench.workload import MODEL

EXACT = ["fp32+ngram", "fp32+self", "hf"]  # must equal fp32 token for token
ENGINES = {
    "fp32": dict(quantization=None),
    "gguf": dict(quantization="auto"),
    "fp32+ngram": dict(quantization=None, speculative_method="ngram"),
    "fp32+self": dict(draft_model="self"),
}


def tokenizer():
    from transformers import AutoTokenizer

    from engine.models.registry import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))


def prompt_ids(tokenizer, length: int) -> list[int]:
    from bench.quality import held_tokens

    return held_tokens(tokenizer, length)


def make_llm(mode: str, threads: int, max_len: int):
    from engine import LLM

    return LLM(
        MODEL,
        num_threads=threads,
        enable_prefix_caching=False,
        max_model_len=max(2048, max_len),
        **ENGINES[mode],
    )


def engine_mode(llm, prompt: list[int], tokens: int) -> Callable[[], Run]:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    def run() -> Run:
        before = counters(llm)
        stamps, ids, first = [], [], 0
        t0 = time.perf_counter()
        for delta in llm.stream(prompt, params):
            stamps.append(time.perf_counter())
            ids += delta.outputs[0].token_ids
            first = first or len(ids)
        steps, drafts, accepted = (b - a for a, b in zip(before, counters(llm), strict=True))
        info = {"tokens": len(ids), "drafts": drafts, "accepted": accepted}
        if steps:
            info["accepted_per_step"] = accepted / steps
        per_token = (stamps[-1] - stamps[0]) / (len(ids) - first)
        metrics = {"ttft": stamps[0] - t0, "per_token": per_token}
        return Run(metrics, [ids], info)

    return run


class _Stamps:
    """A `generate` streamer that stamps each call: the prompt first, then every new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_mode(model, prompt: list[int], tokens: int, cache_implementation=None) -> Callable[[], Run]:
    def run() -> Run:
        stamps = _Stamps()
        t0 = time.perf_counter()
        ids = generate(
            model, [prompt], tokens, streamer=stamps, cache_implementation=cache_implementation
        )
        new = stamps.times[1:]  # the first put() is the prompt
        per_token = (new[-1] - new[0]) / (len(new) - 1)
        metrics = {"ttft": new[0] - t0, "per_token": per_token, "seconds": new[-1] - t0}
        return Run(metrics, ids, {"tokens": len(new)})

    return run


def llama_cpp_dir(arg: str | None = None) -> Path | None:
    from bench.peers import llama_cpp_dir as find

    return find(arg, ("llama-bench",))


def gguf_path() -> Path:
    from engine.models.registry import resolve_model

    return next(resolve_model(MODEL).glob("*.gguf"))


def llama_cpp_mode(bin_dir: Path, prompt_len: int, tokens: int, threads: int) -> Callable[[], Run]:
    """llama-bench on the same GGUF: the prompt's processing rate, then the generation rate at
    a context of prompt_len (`-d`), one repetition each (the rounds are the repeats)."""

    def rate(*args) -> float:
        command = [str(bin_dir / "llama-bench"), "-m", str(gguf_path()), "-t", str(threads)]
        command += [*map(str, args), "-r", "1", "-o", "json"]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        return float(json.loads(out)[0]["avg_ts"])

    def run() -> Run:
        pp = rate("-p", prompt_len, "-n", 0)
        tg = rate("-p", 0, "-n", tokens, "-d", prompt_len)
        return Run({"ttft": prompt_len / pp, "per_token": 1 / tg}, None, {"tokens": tokens})

    return run


def quality_report(threads: int):
    """The documented quality rule (bench/quality.py) for the gguf mode against fp32."""
    from bench.quality import compare, held_tokens, teacher_forced

    fp32, gguf = make_llm("fp32", threads, 2048), make_llm("gguf", threads, 2048)
    ids = held_tokens(fp32.engine.tokenizer, 1024)
    return compare(teacher_forced(fp32, ids), teacher_forced(gguf, ids))


def measure(
    prompt_len: int,
    threads: int,
    tokens: int,
    repeats: int,
    llama_cpp: Path | None = None,
    hf_settings: dict | None = None,
    engines: list[str] | None = None,
) -> dict[str, Timings]:
    """Every mode on one prompt of `prompt_len` tokens, alternated. `hf_settings`: name ->
    (attn_implementation, cache_implementation) of the HF variants to time (default: the
    fastest); `engines`: the engine modes (default: all of ENGINES)."""
    torch.set_num_threads(threads)
    engines = list(ENGINES) if engines is None else engines
    llms = {mode: make_llm(mode, threads, prompt_len + tokens) for mode in engines}
    prompt = prompt_ids(tokenizer(), prompt_len)
    modes = {mode: engine_mode(llm, prompt, tokens) for mode, llm in llms.items()}
    hf_settings = hf_settings or {"hf": tuple(HF_FASTEST.values())}
    hf_models = {}
    for name, (attn, cache) in hf_settings.items():
        model = hf_models.get(attn) or hf_models.setdefault(attn, load_hf_model(attn))
        modes[name] = hf_mode(model, prompt, tokens, cache)
    if llama_cpp:
        modes["llama.cpp"] = llama_cpp_mode(llama_cpp, prompt_len, tokens, threads)
    return alternate(modes, repeats, threads=threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-lens", default="64,512,2048")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-cpp", default=None)
    args = parser.parse_args(argv)
    llama_cpp = llama_cpp_dir(args.llama_cpp)
    if llama_cpp is None:
        print("llama.cpp: no binaries (--llama-cpp DIR or TANDEM_LLAMA_CPP): its side skipped")
    failed, first = False, None
    for threads in map(int, args.threads.split(",")):
        report = quality_report(threads)
        print(f"{threads} thread(s): gguf against fp32: {report}")
        failed |= not report.passes
        for length in map(int, args.prompt_lens.split(",")):
            timings = measure(length, threads, args.tokens, args.repeats, llama_cpp)
            print(f"-- prompt {length} tokens, {threads} thread(s), {args.tokens} new tokens")
            print("time to first token\n" + summary(timings, "ttft", 1e3, "ms"))
            print("per token\n" + summary(timings, "per_token", 1e3, "ms"))
            for name, where in unequal(timings, "fp32", [m for m in EXACT if m in timings]).items():
                print(f"MISMATCH {name} against fp32: {where}")
                failed = True
            first = first or timings

    def x(a: str, b: str) -> str:
        if a not in first or b not in first:
            return "na"
        return f"{first[b].median('per_token') / first[a].median('per_token'):.2f}"

    print(
        f"RESULT gguf_x_fp32={x('gguf', 'fp32')} gguf_x_hf={x('gguf', 'hf')} "
        f"gguf_x_llama_cpp={x('gguf', 'llama.cpp')} self_x_fp32={x('fp32+self', 'fp32')}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
