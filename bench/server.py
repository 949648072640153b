"""Serving over HTTP: concurrent OpenAI clients against the server vs the same requests offline.

    python -m bench.server [--requests 32] [--hf-limit 4] [--no-hf]

SmolLM2-135M-Instruct, one engine thread, greedy, EOS ignored (each request emits exactly its
planned length). The workload is the throughput benchmark's shape (random prompt ids, lognormal
prompt and output lengths), smaller. Modes, in one run:
- **offline**: `LLM.generate` on every request at once (the engine with no HTTP in front);
- **server**: the OpenAI-compatible server (uvicorn in a thread of this process) and one
  `AsyncOpenAI` client per request, all at once, streaming (`stream=True`): wall time from the
  first request sent to the last `[DONE]`, time to first token and time per output token as
  each client sees them;
- **hf_seq**: HF transformers `generate()` one request at a time (the first --hf-limit timed,
  tokens/s extrapolated), the usual reference.
Outputs of server and offline are compared token for token (the completions endpoint takes
prompt token ids; logprobs=0 returns the emitted ids' texts, so the text is compared).
Last line: RESULT server_vs_offline=.. server_vs_hf_seq=.. ttft_p50_ms=.. tpot_p50_ms=..
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import asyncio
import json
import statistics
import time

MODEL = "smollm2-135m-instruct"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--hf-limit", type=int, default=4)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import openai
    import torch

    from bench.workload import make_workload
    from engine import LLM, SamplingParams
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.models.registry import resolve_model
    from playground.async_engine import AsyncEngine
    from playground.launch import serving_in_thread
    from playground.server import ServerState, build_app

    torch.set_num_threads(1)
    vocab = json.loads((resolve_model(MODEL) / "config.json").read_text())["vocab_size"]
    wl = make_workload(args.requests, args.seed, vocab, (96, 0.6, 8, 384), (64, 0.5, 8, 192))
    print(
        f"# {args.requests} requests, {wl.num_prompt_tokens} prompt + {wl.num_output_tokens} "
        "output tokens, SmolLM2-135M fp32, 1 thread",
        flush=True,
    )
    engine_args = dict(num_threads=1, kv_cache_memory_bytes=1 << 30)

    # ---- offline ----
    llm = LLM(MODEL, **engine_args)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.out_lens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=False)
    offline_s = time.perf_counter() - t0
    offline_text = [o.outputs[0].text for o in outs]
    del llm

    # ---- server ----
    state = ServerState(AsyncEngine(LLMEngine(EngineConfig(model=MODEL, **engine_args))), MODEL)
    ttfts: list[float] = []
    tpots: list[float] = []

    async def one(client, i: int) -> str:
        start = time.perf_counter()
        first = last = None
        text = []
        stream = await client.completions.create(
            model=MODEL,
            prompt=wl.prompts[i],
            max_tokens=wl.out_lens[i],
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                last = time.perf_counter()
                first = first or last
                text.append(chunk.choices[0].text)
        ttfts.append(first - start)
        if wl.out_lens[i] > 1:
            tpots.append((last - first) / (wl.out_lens[i] - 1))
        return "".join(text)

    async def everyone(url: str) -> list[str]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            await c.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)  # warm-up
            t = time.perf_counter()
            texts = await asyncio.gather(*(one(c, i) for i in range(len(wl.prompts))))
            everyone.seconds = time.perf_counter() - t
            return texts

    with serving_in_thread(build_app(state)) as url:
        server_text = asyncio.run(everyone(url))
    state.engine.shutdown()
    server_s = everyone.seconds
    same = sum(a == b for a, b in zip(server_text, offline_text, strict=True))

    tokens = wl.num_output_tokens
    print(f"offline  {offline_s:7.2f} s  {tokens / offline_s:7.1f} tok/s")
    print(
        f"server   {server_s:7.2f} s  {tokens / server_s:7.1f} tok/s  outputs equal {same}/"
        f"{len(wl.prompts)}"
    )
    ttft = statistics.median(ttfts) * 1e3
    tpot = statistics.median(tpots) * 1e3
    print(
        f"server   ttft p50 {ttft:.0f} ms  p90 {_p(ttfts, 0.9) * 1e3:.0f} ms  "
        f"time/output token p50 {tpot:.1f} ms  p90 {_p(tpots, 0.9) * 1e3:.1f} ms"
    )
    result = f"server_vs_offline={offline_s / server_s:.3f}"

    if not args.no_hf:
        from bench.hf_baselines import load_hf_model, run_hf_seq

        hf = run_hf_seq(load_hf_model(), wl, args.hf_limit)
        print(f"hf_seq   {hf.out_tok_s:7.1f} tok/s ({'; '.join(hf.notes)})")
        result += f" server_vs_hf_seq={tokens / server_s / hf.out_tok_s:.2f}"
    print(
        f"RESULT {result} ttft_p50_ms={ttft:.0f} tpot_p50_ms={tpot:.1f} "
        f"outputs_equal={same}/{len(wl.prompts)}"
    )
    return 0 if same == len(wl.prompts) else 1


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


if __name__ == "__main__":
    sys.exit(main())
