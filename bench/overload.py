"""The server under a 10x overload: /health latency while a burst of requests ten times the
admission limit arrives at once, how many were refused (429) and served, and whether every KV
block came back after the burst (issue 41, point 2).

    python -m bench.overload [--model NAME] [--max-queued-requests 16] [--overload 10]

`tandem serve` runs in its own process (one engine thread, an API key, the given
--max-queued-requests); this process sends overload x limit streaming-less completions at once
(prompts of ~100 tokens, 32 tokens each, EOS ignored) while another process polls /health every
50 ms over its own connection. Before the burst /health is polled the same way while idle.
Last line: RESULT health_idle_p50_ms=.. health_burst_p50_ms=.. health_burst_p99_ms=..
health_burst_max_ms=.. served=.. refused_429=.. other=.. blocks_back=..
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time

import httpx

from bench.server import serving

KEY = "bench-overload-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def poll_health(url: str, stop, out) -> None:
    """In its own process (the burst's client work does not share its GIL): /health every
    50 ms until stop is set, each answer's seconds appended to out."""
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            start = time.perf_counter()
            assert client.get(url + "/health").status_code == 200
            out.append(time.perf_counter() - start)
            stop.wait(0.05)


def polled(url: str, during) -> list[float]:
    """/health latencies (seconds) while during() runs."""
    with multiprocessing.Manager() as manager:
        stop, out = manager.Event(), manager.list()
        poller = multiprocessing.Process(target=poll_health, args=(url, stop, out))
        poller.start()
        try:
            during()
        finally:
            stop.set()
            poller.join()
        return list(out)


async def burst(url: str, num_requests: int) -> list[int]:
    prompt = " ".join(f"word{i}" for i in range(60))  # ~100 tokens
    body = {"prompt": prompt, "max_tokens": 32, "ignore_eos": True, "temperature": 0}
    limits = httpx.Limits(max_connections=num_requests)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=HEADERS) as client:
        calls = [client.post(url + "/v1/completions", json=body) for _ in range(num_requests)]
        return [r.status_code for r in await asyncio.gather(*calls)]


def percentile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-queued-requests", type=int, default=16)
    parser.add_argument("--overload", type=int, default=10)
    args = parser.parse_args(argv)
    flags = ["--threads", "1", "--api-key", KEY]
    flags += ["--max-queued-requests", str(args.max_queued_requests)]
    num_requests = args.overload * args.max_queued_requests
    with serving(args.model, flags) as url:
        idle = polled(url, lambda: time.sleep(2))
        codes, start = [], time.perf_counter()
        during = polled(url, lambda: codes.extend(asyncio.run(burst(url, num_requests))))
        seconds = time.perf_counter() - start
        snap = httpx.get(url + "/v1/snapshot", headers=HEADERS).json()
    served, refused = codes.count(200), codes.count(429)
    ms = {
        name: 1000 * value
        for name, value in (
            ("idle_p50", statistics.median(idle)),
            ("burst_p50", statistics.median(during)),
            ("burst_p99", percentile(during, 0.99)),
            ("burst_max", max(during)),
        )
    }
    print(f"burst of {len(codes)} requests over {seconds:.1f} s: {served} served, {refused} 429")
    print(
        f"/health: idle p50 {ms['idle_p50']:.1f} ms; during the burst ({len(during)} polls) "
        f"p50 {ms['burst_p50']:.1f}, p99 {ms['burst_p99']:.1f}, max {ms['burst_max']:.1f} ms"
    )
    blocks_back = snap["num_free_blocks"] == snap["num_blocks"]
    print(
        f"RESULT health_idle_p50_ms={ms['idle_p50']:.1f} health_burst_p50_ms={ms['burst_p50']:.1f} "
        f"health_burst_p99_ms={ms['burst_p99']:.1f} health_burst_max_ms={ms['burst_max']:.1f} "
        f"served={served} refused_429={refused} other={len(codes) - served - refused} "
        f"blocks_back={blocks_back}"
    )
    return 0 if blocks_back and served + refused == len(codes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
