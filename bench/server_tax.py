"""What the HTTP server adds to each token at one client (issue 40 point 3): the inter-token
time of one streaming `/v1/completions` request through `tandem serve` against the same request
through `LLM.stream` in this process, same engine settings and threads.

    python -m bench.server_tax [--model smollm2-135m-instruct] [--threads 2] [--requests 6]
        [--repeats 3] [--quantization default|none] [--prompt-tokens 400]

The workload: --requests real English prompts of --prompt-tokens tokens (bench.quality's held
text), 64 new tokens each, greedy, EOS ignored, prefix caching off, sent one after another (one
client). The server is `tandem serve` in its own process; this process is its client (the
openai SDK, one streaming call per request) and, in the other mode, the offline engine (the
server is stopped meanwhile: one engine at a time). Modes alternate: a warm-up each, then
--repeats rounds. Inter-token time: each request's gaps between consecutive token arrivals
pooled over the round's requests;
the round's p50 and p95; median over rounds. Texts must be equal (exit 1 otherwise). CPU time
per output token, prompt steps included: the engine's process (the server, or this one
offline) and the client's, from the kernel's accounting: what the server adds whatever the
load.
Last line: RESULT server_itl_p50_ms=.. offline_itl_p50_ms=.. tax=.. (server / offline)
server_itl_p95_ms=.. offline_itl_p95_ms=.. outputs_equal=..
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

from bench.harness import Run, load_average
from bench.step_budget import NEW_TOKENS, percentile

KV_BYTES = 1 << 30


def prompts_of(tokenizer, count: int, length: int) -> list[list[int]]:
    from bench.quality import held_text

    ids = tokenizer(held_text(), add_special_tokens=False).input_ids
    step = (len(ids) - length) // max(1, count)
    return [ids[i * step : i * step + length] for i in range(count)]


def gaps(stamps: list[float]) -> list[float]:
    """Gaps (ms) between consecutive text deltas (at one client, one token each but where the
    detokenizer holds back an incomplete character: the same in both modes)."""
    return [(t1 - t0) * 1e3 for t0, t1 in zip(stamps, stamps[1:], strict=False)]


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's children: the server."""
    import psutil

    return sum(sum(c.cpu_times()[:2]) for c in psutil.Process().children(recursive=True))


def offline_round(llm, prompts: list[list[int]]) -> Run:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    all_gaps, outputs = [], []
    cpu = time.process_time()
    for prompt in prompts:
        stamps, text = [], []
        for out in llm.stream({"prompt_token_ids": prompt}, params):
            if out.outputs[0].text:
                stamps.append(time.perf_counter())
                text.append(out.outputs[0].text)
        all_gaps += gaps(stamps)
        outputs.append("".join(text))
    return _run(all_gaps, outputs, {"engine_cpu": time.process_time() - cpu})


def server_round(url: str, model: str, prompts: list[list[int]]) -> Run:
    import openai

    async def everything() -> Run:
        all_gaps, outputs = [], []
        cpu, server_cpu = time.process_time(), children_cpu()
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            for prompt in prompts:
                chunks = await c.completions.create(
                    model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                    stream=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                stamps, text = [], []
                async for chunk in chunks:
                    if chunk.choices and chunk.choices[0].text:
                        stamps.append(time.perf_counter())
                        text.append(chunk.choices[0].text)
                all_gaps += gaps(stamps)
                outputs.append("".join(text))
        used = {"client_cpu": time.process_time() - cpu, "engine_cpu": children_cpu() - server_cpu}
        return _run(all_gaps, outputs, used)

    return asyncio.run(everything())


def _run(all_gaps: list[float], outputs: list[str], cpu: dict[str, float]) -> Run:
    """cpu: CPU seconds of the engine's process (and the client's), per output token in ms."""
    metrics = {"p50": statistics.median(all_gaps), "p95": percentile(all_gaps, 0.95)}
    per_token = {k: v * 1e3 / (NEW_TOKENS * len(outputs)) for k, v in cpu.items()}
    return Run(metrics | per_token, None, {"texts": outputs})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--quantization", default="default", choices=("default", "none"))
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    from bench.server import serving
    from engine import LLM

    engine_args = dict(
        num_threads=args.threads, kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False
    )
    flags = ["--threads", str(args.threads), "--kv-cache-memory-bytes", str(KV_BYTES)]
    flags += ["--no-prefix-caching"]
    if args.quantization == "none":
        engine_args["quantization"], flags = None, flags + ["--quantization", "none"]

    timings: dict[str, list[Run]] = {"offline": [], "server": []}
    prompts = None
    for r in range(args.repeats + 1):  # round 0 warms both modes up
        llm = LLM(args.model, **engine_args)
        prompts = prompts or prompts_of(llm.tokenizer, args.requests, args.prompt_tokens)
        run = offline_round(llm, prompts)
        del llm
        if r:
            timings["offline"].append(run)
        with serving(args.model, flags) as url:
            run = server_round(url, args.model, prompts)
        if r:
            timings["server"].append(run)
        print(f"round {r}: load {load_average():.1f}", file=sys.stderr)

    med = {m: {k: statistics.median(x.metrics[k] for x in runs) for k in ("p50", "p95")}
           for m, runs in timings.items()}  # fmt: skip
    equal = all(a.info["texts"] == b.info["texts"] for a, b in zip(*timings.values(), strict=True))
    for mode, runs in timings.items():
        p50s = ", ".join(f"{x.metrics['p50']:.2f}" for x in runs)
        cpu = ", ".join(
            f"{k} {statistics.median(x.metrics[k] for x in runs):.2f}"
            for k in ("engine_cpu", "client_cpu") if k in runs[0].metrics
        )  # fmt: skip
        print(f"{mode}: inter-token p50 {med[mode]['p50']:.2f} ms (rounds {p50s}), "
              f"p95 {med[mode]['p95']:.2f} ms; CPU ms per token: {cpu}")  # fmt: skip
    tax = med["server"]["p50"] / med["offline"]["p50"]
    print(
        f"RESULT server_itl_p50_ms={med['server']['p50']:.2f} "
        f"offline_itl_p50_ms={med['offline']['p50']:.2f} tax={tax:.3f} "
        f"server_itl_p95_ms={med['server']['p95']:.2f} "
        f"offline_itl_p95_ms={med['offline']['p95']:.2f} outputs_equal={equal}"
    )
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
