"""Serving over HTTP: concurrent OpenAI clients against the server vs the same requests offline.

    python -m bench.server [--requests 32] [--repeats 2] [--hf-limit 4] [--no-hf]

SmolLM2-135M-Instruct, one engine thread, greedy, EOS ignored (each request emits exactly its
planned length). The workload is the throughput benchmark's shape (random prompt ids, lognormal
prompt and output lengths), smaller. Modes, in one run:
- **offline**: `LLM.generate` on every request at once (the engine with no HTTP in front);
- **server**: `tandem serve` in its own process (same engine settings) and one `AsyncOpenAI`
  client per request in this one, all at once, streaming (`stream=True`): wall time from the
  first request sent to the last `[DONE]`, time to first token and time per output token as
  each client sees them;
- **hf_seq**: HF transformers `generate()` one request at a time (the first --hf-limit timed,
  tokens/s extrapolated), the usual reference.
Outputs of server and offline are compared token for token (the completions endpoint takes
prompt token ids; logprobs=0 returns the emitted ids' texts, so the text is compared).
The server answers whole responses (stream=False) and streamed ones; the three modes alternate
--repeats times and each keeps its best time (prefix caching off everywhere, so no repeat finds
the last one's prompts cached). Clients and server share this machine's two cores, so the
streamed mode also measures 32 clients parsing SSE chunks next to the engine; the stats
(time to first token, time per output token) come from the last streamed repeat.
Last line: RESULT server_whole_vs_offline=.. server_stream_vs_offline=.. server_vs_hf_seq=..
ttft_p50_ms=.. tpot_p50_ms=.. outputs_equal=../..
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
import subprocess
import time
from collections.abc import Callable

from bench.workload import Workload, make_workload

MODEL = "smollm2-135m-instruct"
# No prefix caching anywhere: repeats must not find the previous run's prompts cached.
ENGINE_ARGS = dict(
    num_threads=1,
    kv_cache_memory_bytes=1 << 30,
    enable_prefix_caching=False,
    quantization=None,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--hf-limit", type=int, default=4)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    wl = build_workload(args.requests, args.seed)
    best, texts, clients = run_modes(wl, args.repeats)
    n = len(wl.prompts)
    same = count_equal(texts)
    tokens = wl.num_output_tokens
    print_times(best, tokens, same, n)
    ttft, tpot = print_latencies(clients.ttfts, clients.tpots)
    offline_s, whole_s, server_s = best["offline"], best["whole"], best["stream"]
    result = (
        f"server_whole_vs_offline={offline_s / whole_s:.3f} "
        f"server_stream_vs_offline={offline_s / server_s:.3f}"
    )
    if not args.no_hf:
        result += f" server_vs_hf_seq={tokens / server_s / hf_seq_tok_s(wl, args.hf_limit):.2f}"
    print(
        f"RESULT {result} ttft_p50_ms={ttft:.0f} tpot_p50_ms={tpot:.1f} "
        f"outputs_equal={same}/{2 * n}"
    )
    return 0 if same == 2 * n else 1


def build_workload(num_requests: int, seed: int) -> Workload:
    """The throughput benchmark's shape of workload, smaller; prints its size."""
    from engine.models.registry import resolve_model

    vocab = json.loads((resolve_model(MODEL) / "config.json").read_text())["vocab_size"]
    wl = make_workload(num_requests, seed, vocab, (96, 0.6, 8, 384), (64, 0.5, 8, 192))
    print(
        f"# {num_requests} requests, {wl.num_prompt_tokens} prompt + {wl.num_output_tokens} "
        "output tokens, SmolLM2-135M fp32, 1 thread",
        flush=True,
    )
    return wl


def run_modes(wl: Workload, repeats: int) -> tuple[dict[str, float], dict[str, list[str]], Clients]:
    """Alternates the three modes `repeats` times: each mode's best seconds and last texts, and
    the clients, holding the stats of the last streamed repeat."""
    offline = offline_runner(wl)
    server, url = start_server()
    clients = Clients(wl, url)
    best = {"offline": float("inf"), "whole": float("inf"), "stream": float("inf")}
    texts: dict[str, list[str]] = {}
    try:
        for _ in range(repeats):
            for mode in best:
                clients.ttfts.clear()
                clients.tpots.clear()
                if mode == "offline":
                    texts[mode], seconds = offline()
                else:
                    texts[mode], seconds = asyncio.run(clients.everyone(stream=mode == "stream"))
                print(f"# {mode:8s} {seconds:7.2f} s", flush=True)
                best[mode] = min(best[mode], seconds)
    finally:
        server.terminate()
        server.wait(30)
    return best, texts, clients


def offline_runner(wl: Workload) -> Callable[[], tuple[list[str], float]]:
    """The engine with no HTTP in front, loaded and warmed up; each call of the function returned
    runs every request at once: (texts, seconds)."""
    from engine import LLM, SamplingParams

    llm = LLM(MODEL, **ENGINE_ARGS)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.out_lens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up

    def offline() -> tuple[list[str], float]:
        t0 = time.perf_counter()
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        return [o.outputs[0].text for o in outs], time.perf_counter() - t0

    return offline


def start_server() -> tuple[subprocess.Popen, str]:
    """`tandem serve` in its own process, as deployed (the clients' work does not share its GIL),
    with ENGINE_ARGS' settings; (the process, its URL) once it answers /health."""
    from playground.launch import free_port

    port = free_port()
    command = [sys.executable, "-m", "playground.cli", "serve", "--model", MODEL]
    command += ["--port", str(port)]
    command += ["--threads", "1", "--kv-cache-memory-bytes", str(1 << 30), "--no-prefix-caching"]
    command += ["--quantization", "none"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, server)
    return server, url


class Clients:
    """One `AsyncOpenAI` client per request against the server at `url`, all at once; streamed
    requests add their time to first token and time per output token (seconds) to ttfts and
    tpots."""

    def __init__(self, wl: Workload, url: str) -> None:
        self.wl, self.url = wl, url
        self.ttfts: list[float] = []
        self.tpots: list[float] = []

    async def everyone(self, stream: bool) -> tuple[list[str], float]:
        import openai

        async with openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0) as c:
            await c.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)  # warm-up
            t = time.perf_counter()
            num = len(self.wl.prompts)
            texts = await asyncio.gather(*(self.one(c, i, stream) for i in range(num)))
            return texts, time.perf_counter() - t

    async def one(self, client, i: int, stream: bool) -> str:
        wl = self.wl
        args = dict(model=MODEL, prompt=wl.prompts[i], max_tokens=wl.out_lens[i], temperature=0)
        if not stream:
            r = await client.completions.create(**args, extra_body={"ignore_eos": True})
            return r.choices[0].text
        start = time.perf_counter()
        first = last = None
        text = []
        chunks = await client.completions.create(
            **args, stream=True, extra_body={"ignore_eos": True}
        )
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].text:
                last = time.perf_counter()
                first = first or last
                text.append(chunk.choices[0].text)
        self.ttfts.append(first - start)
        if wl.out_lens[i] > 1:
            self.tpots.append((last - first) / (wl.out_lens[i] - 1))
        return "".join(text)


def count_equal(texts: dict[str, list[str]]) -> int:
    """Server outputs equal to offline's, whole and streamed together (of 2 x requests)."""
    same = sum(a == b for a, b in zip(texts["whole"], texts["offline"], strict=True))
    same += sum(a == b for a, b in zip(texts["stream"], texts["offline"], strict=True))
    return same


def print_times(best: dict[str, float], tokens: int, same: int, num_requests: int) -> None:
    offline_s, whole_s, server_s = best["offline"], best["whole"], best["stream"]
    print(f"offline          {offline_s:7.2f} s  {tokens / offline_s:7.1f} tok/s")
    print(f"server, whole    {whole_s:7.2f} s  {tokens / whole_s:7.1f} tok/s")
    print(f"server, streamed {server_s:7.2f} s  {tokens / server_s:7.1f} tok/s")
    print(f"outputs equal to offline: {same}/{2 * num_requests}")


def print_latencies(ttfts: list[float], tpots: list[float]) -> tuple[float, float]:
    """Prints the streamed requests' p50 and p90; returns the p50s in milliseconds."""
    ttft = statistics.median(ttfts) * 1e3
    tpot = statistics.median(tpots) * 1e3
    print(
        f"streamed: ttft p50 {ttft:.0f} ms  p90 {_p(ttfts, 0.9) * 1e3:.0f} ms  "
        f"time/output token p50 {tpot:.1f} ms  p90 {_p(tpots, 0.9) * 1e3:.1f} ms"
    )
    return ttft, tpot


def hf_seq_tok_s(wl: Workload, hf_limit: int) -> float:
    """HF `generate()` one request at a time, the first hf_limit timed: output tokens/s."""
    from bench.hf_baselines import load_hf_model, run_hf_seq

    hf = run_hf_seq(load_hf_model(), wl, hf_limit)
    print(f"hf_seq   {hf.out_tok_s:7.1f} tok/s ({'; '.join(hf.notes)})")
    return hf.out_tok_s


def _wait_healthy(url: str, process, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {url} did not come up (exit code {process.poll()})")


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


if __name__ == "__main__":
    sys.exit(main())
