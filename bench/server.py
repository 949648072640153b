"""Serving over HTTP: time to first token, time per output token and wall time through
`tandem serve`, against the same requests offline.

    python -m bench.server [--requests 32] [--repeats 3] [--no-whole] [--seed 0]

SmolLM2-135M-Instruct fp32, one engine thread, greedy, EOS ignored (each request emits exactly
its planned length), prefix caching off (no round finds the last one's prompts cached). The
workload is the throughput benchmark's shape (random prompt ids, lognormal prompt and output
lengths), smaller. Every request is submitted at once in each mode:
- **offline**: `LLMEngine.add_request` for every request, then `step()` until all are done, in
  this process, each request's deltas stamped as they come out of a step (the engine with no
  HTTP in front);
- **server**: `tandem serve` in its own process (same engine settings, a free port) and one
  streaming `AsyncOpenAI` completions call per request from this one, each chunk stamped as
  the client receives it;
- **server-whole** (unless --no-whole): the same calls with `stream=False` (wall time only).
Per run: `seconds` (first request sent to last one done), `ttft` (median over the requests of
the time from sending to the first token) and `tpot` (median over the requests of
(last token - first token) / (output tokens - 1)). The modes alternate (bench/harness.py: a
warm-up each, then --repeats rounds, median and spread). The server's texts and token counts
(usage) must equal the offline ones request for request (the completions endpoint returns text,
not ids; exit 1 otherwise).
Clients and server share this machine's cores, so the server mode also measures the clients
parsing SSE chunks next to the engine. HF transformers is not run here: the HF comparison on
this workload's shape is bench.throughput's (--hf-limit and --no-hf are accepted, and ignored).
Last line: RESULT server_stream_vs_offline=.. server_whole_vs_offline=.. ttft_p50_ms=..
tpot_p50_ms=.. offline_ttft_p50_ms=.. offline_tpot_p50_ms=.. outputs_equal=../..
(the ratios are offline seconds / server seconds, < 1 when the server is slower).
"""

from __future__ import annotations

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import asyncio
import contextlib
import itertools
import json
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator

from bench.harness import Run, Timings, alternate, summary
from bench.workload import Workload, make_workload

MODEL = "smollm2-135m-instruct"
KV_BYTES = 1 << 30
ENGINE_ARGS = dict(
    num_threads=1,
    kv_cache_memory_bytes=KV_BYTES,
    enable_prefix_caching=False,
    quantization=None,
)
# The same settings as `tandem serve` flags (the other EngineConfig fields: both defaults).
SERVER_FLAGS = ["--threads", "1", "--kv-cache-memory-bytes", str(KV_BYTES)]
SERVER_FLAGS += ["--no-prefix-caching", "--quantization", "none"]
# (median, sigma, min, max) of the prompt and output lengths: the full run, and the quick one.
FULL_SHAPE = ((96, 0.6, 8, 384), (64, 0.5, 8, 192))
QUICK_SHAPE = ((48, 0.5, 8, 96), (12, 0.3, 4, 16))


def build_workload(num_requests: int, seed: int, quick: bool = False) -> Workload:
    from engine.models.registry import resolve_model

    vocab = json.loads((resolve_model(MODEL) / "config.json").read_text())["vocab_size"]
    return make_workload(num_requests, seed, vocab, *(QUICK_SHAPE if quick else FULL_SHAPE))


def latency(seconds: float, starts: list[float], stamps: list[list[float]], wl: Workload) -> dict:
    """The run's metrics from each request's start and the times its tokens arrived (one stamp
    per delta: a delta may hold several tokens, so time per token divides by the token count)."""
    ttfts = [s[0] - start for start, s in zip(starts, stamps, strict=True)]
    tpots = [(s[-1] - s[0]) / (n - 1) for s, n in zip(stamps, wl.out_lens, strict=True) if n > 1]
    return {"seconds": seconds, "ttft": statistics.median(ttfts), "tpot": statistics.median(tpots)}


def offline_mode(llm, wl: Workload) -> Callable[[], Run]:
    """Every request added at once to the engine, then stepped to the end; texts and token ids
    are the deltas joined."""
    from engine import RequestOutputKind, SamplingParams

    delta = RequestOutputKind.DELTA
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=delta)
        for n in wl.out_lens
    ]
    engine, calls = llm.engine, itertools.count()

    def run() -> Run:
        ids = [f"offline-{next(calls)}-{i}" for i in range(len(wl.prompts))]
        index = {rid: i for i, rid in enumerate(ids)}
        stamps: list[list[float]] = [[] for _ in ids]
        texts, tokens = [""] * len(ids), [[] for _ in ids]
        t0 = time.perf_counter()
        for rid, prompt, p in zip(ids, wl.prompts, params, strict=True):
            engine.add_request(rid, prompt, p)
        while engine.has_unfinished_requests():
            for out in engine.step():
                i = index[out.request_id]
                if out.outputs[0].token_ids:
                    stamps[i].append(time.perf_counter())
                    tokens[i] += out.outputs[0].token_ids
                    texts[i] += out.outputs[0].text
        seconds = time.perf_counter() - t0
        metrics = latency(seconds, [t0] * len(ids), stamps, wl)
        counts = list(map(len, tokens))
        return Run(metrics, tokens, {"tokens": sum(counts), "texts": texts, "counts": counts})

    return run


def server_mode(url: str, wl: Workload, stream: bool) -> Callable[[], Run]:
    """One `AsyncOpenAI` completions call per request, all at once (a client per run: its
    connections belong to the run's event loop)."""

    async def one(client, i: int, stamps: list[float]) -> tuple[str, int]:
        args = dict(model=MODEL, prompt=wl.prompts[i], max_tokens=wl.out_lens[i], temperature=0)
        args["extra_body"] = {"ignore_eos": True}
        if not stream:
            r = await client.completions.create(**args)
            stamps.append(time.perf_counter())
            return r.choices[0].text, r.usage.completion_tokens
        chunks = await client.completions.create(
            **args, stream=True, stream_options={"include_usage": True}
        )
        text, num_tokens = [], 0
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.perf_counter())
                text.append(chunk.choices[0].text)
            if chunk.usage:
                num_tokens = chunk.usage.completion_tokens
        return "".join(text), num_tokens

    async def everyone() -> Run:
        import openai

        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            stamps: list[list[float]] = [[] for _ in wl.prompts]
            t0 = time.perf_counter()
            done = await asyncio.gather(*(one(c, i, s) for i, s in enumerate(stamps)))
            seconds = time.perf_counter() - t0
        texts, counts = [text for text, _ in done], [n for _, n in done]
        info = {"tokens": sum(counts), "texts": texts, "counts": counts}
        if not stream:
            return Run({"seconds": seconds}, None, info)
        return Run(latency(seconds, [t0] * len(stamps), stamps, wl), None, info)

    return lambda: asyncio.run(everyone())


@contextlib.contextmanager
def serving(model: str = MODEL, flags: list[str] | None = None) -> Iterator[str]:
    """`tandem serve` in its own process (the clients' work does not share its GIL) on a free
    port, with ENGINE_ARGS' settings (or `flags`); yields its URL once it answers /health and
    terminates it on the way out, whatever happened (killed if it does not stop in 30 s)."""
    from playground.launch import free_port

    port = free_port()
    command = [sys.executable, "-m", "playground.cli", "serve", "--model", model]
    command += ["--port", str(port), *(SERVER_FLAGS if flags is None else flags)]
    with launched(command, f"http://127.0.0.1:{port}") as url:
        yield url


@contextlib.contextmanager
def launched(
    command: list[str], url: str, env: dict | None = None, timeout: float = 300.0
) -> Iterator[str]:
    """Any HTTP server (ours, llama-server, vLLM) started by `command`, in a session of its own:
    yields `url` once `url`/health answers 200 and stops it on the way out. A server that
    forks workers (vLLM) is stopped with them: whatever of its process group outlives it is
    killed."""
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        try:
            _wait_healthy(url, server, log, timeout)
            yield url
        finally:
            stop(server)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)  # the group id is its pid


def _die_with_parent() -> None:
    """In the server's process before it starts: on Linux, SIGTERM when the benchmark's process
    dies without reaching `serving`'s cleanup (killed), so no server outlives it."""
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)


def stop(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM (the server drains and exits), then SIGKILL if it has not within `grace` s."""
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _wait_healthy(url: str, process: subprocess.Popen, log, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    log.seek(0)
    tail = log.read().decode(errors="replace")[-2000:]
    raise RuntimeError(f"the server at {url} did not come up (exit {process.poll()}):\n{tail}")


def measure(wl: Workload, repeats: int, whole: bool = False) -> dict[str, Timings]:
    """offline, server (and server-whole) alternated on the workload; the server process lives
    for this call only."""
    from engine import LLM

    llm = LLM(MODEL, **ENGINE_ARGS)
    with serving() as url:
        modes = {"offline": offline_mode(llm, wl), "server": server_mode(url, wl, stream=True)}
        if whole:
            modes["server-whole"] = server_mode(url, wl, stream=False)
        return alternate(modes, repeats, threads=1)


def mismatches(timings: dict[str, Timings]) -> dict[str, list[int]]:
    """Server modes whose texts or token counts differ from offline's: the requests that
    differ."""
    want, found = timings["offline"].info, {}
    for name in (m for m in timings if m != "offline"):
        got = timings[name].info
        pairs = zip(want["texts"], want["counts"], got["texts"], got["counts"], strict=True)
        bad = [i for i, (a, n, b, m) in enumerate(pairs) if (a, n) != (b, m)]
        if bad:
            found[name] = bad
    return found


def describe(timings: dict[str, Timings], name: str, bad: list[int]) -> str:
    want, got, i = timings["offline"].info, timings[name].info, bad[0]
    return (
        f"{len(bad)} requests differ, first {i}: {want['texts'][i]!r} ({want['counts'][i]} "
        f"tokens) against {got['texts'][i]!r} ({got['counts'][i]} tokens)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--whole",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time whole (stream=False) responses (default: on)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-limit", type=int, default=None, help="ignored (see bench.throughput)")
    ap.add_argument("--no-hf", action="store_true", help="ignored (see bench.throughput)")
    args = ap.parse_args(argv)
    wl = build_workload(args.requests, args.seed)
    print(
        f"# {args.requests} requests, {wl.num_prompt_tokens} prompt + {wl.num_output_tokens} "
        f"output tokens, {MODEL} fp32, 1 engine thread, {args.repeats} rounds",
        flush=True,
    )
    timings = measure(wl, args.repeats, args.whole)
    print("wall seconds\n" + summary(timings, "seconds"))
    streamed = {k: v for k, v in timings.items() if k != "server-whole"}
    print("time to first token\n" + summary(streamed, "ttft", 1e3, "ms"))
    print("time per output token\n" + summary(streamed, "tpot", 1e3, "ms"))
    bad = mismatches(timings)
    for name, requests in bad.items():
        print(f"MISMATCH {name} against offline: {describe(timings, name, requests)}")
    num_checked = len(wl.prompts) * (len(timings) - 1)
    num_equal = num_checked - sum(map(len, bad.values()))

    def vs(name: str) -> str:
        return f"{timings['offline'].median('seconds') / timings[name].median('seconds'):.3f}"

    ms = {k: t.median("ttft") * 1e3 for k, t in streamed.items()}
    per = {k: t.median("tpot") * 1e3 for k, t in streamed.items()}
    whole = f" server_whole_vs_offline={vs('server-whole')}" if args.whole else ""
    print(
        f"RESULT server_stream_vs_offline={vs('server')}{whole} "
        f"ttft_p50_ms={ms['server']:.0f} tpot_p50_ms={per['server']:.1f} "
        f"offline_ttft_p50_ms={ms['offline']:.0f} offline_tpot_p50_ms={per['offline']:.1f} "
        f"outputs_equal={num_equal}/{num_checked}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
