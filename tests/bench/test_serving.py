"""The serving benchmark's client (bench/serving.py) against a fake streaming server: closed
loops keep exactly c requests in flight, latencies come from the chunks' arrival, and a server
that returns one token too few (or the wrong prompt count, or an error) is caught."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench import serving
from bench.serving import Sample, closed_loop, figures, num_requests, wrong_counts


class FakeServer:
    """Streams `num_tokens` one-character chunks per request, then a usage chunk with no
    choices (llama-server's and vLLM's shape), on a connection it closes after each request."""

    def __init__(self, num_tokens: int = serving.NEW_TOKENS, prompt_offset: int = 0):
        self.num_tokens, self.prompt_offset = num_tokens, prompt_offset
        self.active = self.peak = self.served = 0
        self.bodies: list[dict] = []

    async def handle(self, reader, writer) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
        length = int(head.split("content-length:")[1].split("\r\n")[0])
        body = json.loads(await reader.readexactly(length))
        self.bodies.append(body)
        self.active += 1
        self.peak = max(self.peak, self.active)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        writer.write(b"connection: close\r\n\r\n")
        for _ in range(self.num_tokens):
            await asyncio.sleep(0.001)
            writer.write(b'data: {"choices": [{"text": "a", "index": 0}]}\n\n')
            await writer.drain()
        usage = {"prompt_tokens": len(body["prompt"]) + self.prompt_offset}
        usage["completion_tokens"] = self.num_tokens
        writer.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()
        self.active -= 1
        self.served += 1
        writer.close()


def run_loop(server: FakeServer, prompts: list[list[int]], concurrency: int):
    async def main():
        listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        async with listener:
            return await closed_loop(f"http://127.0.0.1:{port}", prompts, concurrency)

    return asyncio.run(main())


PROMPTS = [[7] * n for n in (3, 5, 8, 2, 9, 4, 6, 1)]


def test_closed_loop_keeps_c_requests_in_flight_and_counts_every_token():
    server = FakeServer()
    seconds, samples = run_loop(server, PROMPTS, concurrency=3)
    assert (server.peak, server.served) == (3, 8)
    assert [len(s.stamps) for s in samples] == [serving.NEW_TOKENS] * 8
    assert wrong_counts(samples, PROMPTS) == []
    body = server.bodies[0]
    assert (body["max_tokens"], body["temperature"], body["ignore_eos"]) == (64, 0, True)
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    got = figures(seconds, samples)
    assert got["tok_s"] == pytest.approx(8 * serving.NEW_TOKENS / seconds)
    assert got["tok_per_chunk"] == 1.0
    assert 0 < got["itl_p50"] <= got["itl_p95"] <= got["itl_p99"] < seconds


def test_a_request_short_of_its_tokens_or_its_prompt_is_caught():
    """The broken variants: one token too few, one prompt token too many, an HTTP error."""
    _, samples = run_loop(FakeServer(num_tokens=serving.NEW_TOKENS - 1), PROMPTS[:2], 2)
    bad = wrong_counts(samples, PROMPTS[:2])
    assert len(bad) == 2 and "'completion_tokens': 63" in bad[0] and "64 new" in bad[0]
    _, samples = run_loop(FakeServer(prompt_offset=1), PROMPTS[:2], 2)
    assert wrong_counts(samples, PROMPTS[:2])[1].startswith("request 1: usage {'prompt_tokens': 6")
    failed = Sample(0.0, error="HTTP 500: b'boom'")
    assert wrong_counts([failed], [[1]]) == ["request 0: HTTP 500: b'boom'"]


def test_figures_from_arrival_times():
    """TTFT from the send to the first chunk; inter-token gaps within a request only; time per
    output token over each request's tokens after its first."""
    samples = [
        Sample(0.0, [1.0, 1.5, 2.5], {"completion_tokens": 3}),
        Sample(1.0, [4.0, 4.25], {"completion_tokens": 2}),
    ]
    got = figures(5.0, samples)
    assert got["tok_s"] == 1.0 and got["per_token"] == 1.0
    assert (got["ttft_p50"], got["ttft_p95"]) == (2.0, 3.0)
    assert (got["itl_p50"], got["itl_p95"], got["itl_p99"]) == (0.5, 1.0, 1.0)
    assert (got["tpot_p50"], got["tpot_p95"]) == (0.5, 0.75)  # 1.5 s / 2 tokens, 0.25 s / 1


def test_requests_per_concurrency_follow_the_issue():
    assert [num_requests(c, 1.0) for c in (1, 4, 16)] == [8, 16, 64]
    assert [num_requests(c, 0.5) for c in (1, 4, 16)] == [4, 8, 32]
    assert num_requests(16, 0.01) == 16  # never fewer requests than clients
