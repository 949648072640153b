"""Soak: a bounded load test against `tandem serve` on loopback, checking that nothing is lost.

    python -m bench.soak [--requests 2000] [--minutes 10] [--clients 32] [--model M]
                         [--kv-blocks 48] [--templates 48] [--abort-rate 0.1] [--seed 0]

The server runs in its own process as deployed (`python -m playground.cli serve`): n-gram
speculation, the two demo PEFT adapters, an API key, and a KV pool of --kv-blocks blocks (small
by default, so that preemption storms happen under load). A pool of --templates distinct greedy
requests mixes completions and chats, a shared system prompt, n = 1 or 2, the base model and
both adapters, JSON-schema / regex / choice constraints, and per-request speculation settings.
Each template is first run alone (one at a time: the reference). Then --clients concurrent
clients send templates picked at random, streamed or whole, until --requests are sent or
--minutes pass; --abort-rate of the sends are abandoned on purpose (a streamed one after a few
chunks, a whole one after a random short wait: the client disconnects).

Checks: zero 5xx (and zero unexpected 4xx); every completed output equal to its template's
output alone; at the end the engine idle with every KV block free, no grammar matcher live and
no request error (from /metrics); the server's RSS sampled every few seconds, its growth from
the end of the first quarter to the end reported (flat after warm-up). Last line:
RESULT soak_requests=.. completed=.. aborted=.. server_errors=.. mismatches=.. preemptions=..
free_blocks_ok=.. rss_growth_mb=..
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

API_KEY = "soak-key"
SYSTEM = "You are a terse assistant. Answer in a few words."
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
TOPICS = ["colours", "rivers", "planets", "fruits", "metals", "birds", "trees", "tools"]


@dataclass
class Template:
    path: str
    body: dict
    reference: list[str] = field(default_factory=list)  # the choices' texts, run alone


def make_templates(n: int, seed: int, model: str, adapters: list[str]) -> list[Template]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        body: dict = {
            "model": rng.choice([model, *adapters]),
            "temperature": 0,
            "max_tokens": rng.randint(4, 40),
            "n": rng.choice([1, 1, 1, 2]),
        }
        k = rng.choice([None, None, 0, 2, 4])
        if k is not None:
            body["num_speculative_tokens"] = k
        constraint = rng.choice([None, None, None, "json", "regex", "choice"])
        if constraint == "json":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA},
            }
        elif constraint == "regex":
            body["structured_outputs"] = {"regex": "[A-Z][a-z]{2,8}( [a-z]{2,8}){0,3}"}
        elif constraint == "choice":
            body["structured_outputs"] = {"choice": ["yes", "no", "maybe"]}
        if rng.random() < 0.5:
            path = "/v1/chat/completions"
            messages = [{"role": "user", "content": f"Name {i % 5 + 2} {topic}."}]
            if rng.random() < 0.6:  # shared prefix: the same system prompt
                messages.insert(0, {"role": "system", "content": SYSTEM})
            body["messages"] = messages
        else:
            path = "/v1/completions"
            body["prompt"] = f"{SYSTEM}\nA list of {topic}, number {i}:"
        out.append(Template(path, body))
    return out


def texts(response: dict) -> list[str]:
    choices = sorted(response["choices"], key=lambda c: c["index"])
    return [c["message"]["content"] if "message" in c else c["text"] for c in choices]


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    aborted: int = 0
    server_errors: int = 0
    client_errors: int = 0
    mismatches: int = 0
    streamed: int = 0
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(what)


async def send(client, template: Template, stream: bool, abort_after: float | None, tally: Tally):
    body = dict(template.body, stream=stream)
    tally.sent += 1
    tally.streamed += stream
    try:
        if stream:
            got = [""] * body["n"]
            chunks = 0
            async with client.stream("POST", template.path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return _status(r, tally)
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        tally.server_errors += 1
                        tally.note(f"stream error: {payload['error']}")
                        return
                    for c in payload["choices"]:
                        delta = c.get("delta", {}).get("content") if "delta" in c else c["text"]
                        got[c["index"]] += delta or ""
                    chunks += 1
                    if abort_after is not None and chunks >= 2:
                        tally.aborted += 1
                        return  # leaving the block closes the connection: a disconnect
        else:
            request = client.post(template.path, json=body)
            if abort_after is not None:
                try:
                    r = await asyncio.wait_for(request, abort_after)
                except TimeoutError:
                    tally.aborted += 1
                    return
            else:
                r = await request
            if r.status_code != 200:
                return _status(r, tally)
            got = texts(r.json())
    except httpx.HTTPError as exc:
        tally.server_errors += 1
        tally.note(f"transport: {exc!r}")
        return
    tally.completed += 1
    if got != template.reference:
        tally.mismatches += 1
        tally.note(f"mismatch {template.body}: {got!r} != {template.reference!r}")


def _status(r: httpx.Response, tally: Tally) -> None:
    if r.status_code >= 500:
        tally.server_errors += 1
    else:
        tally.client_errors += 1
    tally.note(f"HTTP {r.status_code}: {r.text[:200]}")


def metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in s.labels.items()) + "}")
            values[key if s.labels else s.name] = s.value
    return values


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["tandem_num_requests_running"] == 0 and m["tandem_num_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.2)


async def soak(url: str, templates: list[Template], args, pid: int) -> tuple[Tally, list]:
    import psutil

    rng = random.Random(args.seed + 1)
    tally = Tally()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    deadline = time.monotonic() + args.minutes * 60
    rss: list[tuple[float, float]] = []
    process = psutil.Process(pid)
    t0 = time.monotonic()

    async def client_loop(client):
        while tally.sent < args.requests and time.monotonic() < deadline:
            template = rng.choice(templates)
            stream = rng.random() < 0.5
            abort = rng.uniform(0.05, 1.0) if rng.random() < args.abort_rate else None
            await send(client, template, stream, abort, tally)

    async def sample_rss():
        while True:
            rss.append((time.monotonic() - t0, process.memory_info().rss / 2**20))
            await asyncio.sleep(0.25)  # cheap; a short soak still gets a series

    limits = httpx.Limits(max_connections=args.clients * 2)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=300, limits=limits
    ) as client:
        sampler = asyncio.ensure_future(sample_rss())
        await asyncio.gather(*(client_loop(client) for _ in range(args.clients)))
        sampler.cancel()
    rss.append((time.monotonic() - t0, process.memory_info().rss / 2**20))
    return tally, rss


def start_server(args, adapters: dict[str, str]) -> tuple[subprocess.Popen, str]:
    from playground.launch import free_port

    port = free_port()
    command = [
        sys.executable,
        "-m",
        "playground.cli",
        "serve",
        "--model",
        args.model,
        "--port",
        str(port),
        "--api-key",
        API_KEY,
        "--speculative-method",
        "ngram",
        "--threads",
        "1",
        "--max-model-len",
        "1024",
        *[x for name, path in adapters.items() for x in ("--lora", f"{name}={path}")],
    ]
    if args.kv_blocks:
        command += ["--kv-cache-memory-bytes", str(args.kv_blocks * args.block_bytes)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"tandem serve exited: {server.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("tandem serve did not come up")


def run(args) -> dict:
    """The whole soak; returns the figures (also used by tests/e2e/test_soak.py)."""
    from transformers import AutoConfig

    from bench.server import stop
    from engine.models.architectures import model_config
    from engine.models.registry import resolve_model
    from playground.demo_adapters import write_demo_adapters

    cfg = model_config(AutoConfig.from_pretrained(str(resolve_model(args.model))))
    args.block_bytes = cfg.kv_bytes_per_block(16)
    adapters = {name: r.path for name, r in write_demo_adapters(args.model).items()}
    server, url = start_server(args, adapters)
    try:
        templates = make_templates(args.templates, args.seed, args.model, list(adapters))
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=url, headers=headers, timeout=300) as client:
            for t in templates:  # alone, one at a time: the references (and the warm-up)
                r = client.post(t.path, json=t.body)
                if r.status_code != 200:
                    raise RuntimeError(f"template refused: {t.body}: {r.text[:300]}")
                t.reference = texts(r.json())
        before = metrics(url)
        t0 = time.monotonic()
        tally, rss = asyncio.run(soak(url, templates, args, server.pid))
        seconds = time.monotonic() - t0
        after = wait_idle(url)
        health = httpx.get(url + "/health").status_code
    finally:
        stop(server)
    used = after["tandem_kv_blocks{state=used}"]
    quarter = [m for t, m in rss if t >= rss[-1][0] / 4]
    return {
        "seconds": seconds,
        "tally": tally,
        "health": health,
        "free_blocks_ok": used == 0,
        "matchers": after.get("tandem_grammar_matchers", float("nan")),
        "request_errors": after.get("tandem_request_errors_total", float("nan")),
        "preemptions": after["tandem_num_preemptions_total"]
        - before["tandem_num_preemptions_total"],
        "rss_start_mb": rss[0][1],
        "rss_warm_mb": quarter[0] if quarter else rss[-1][1],
        "rss_end_mb": rss[-1][1],
        "rss_growth_mb": rss[-1][1] - (quarter[0] if quarter else rss[-1][1]),
        "rss_series": [rss[round(i * (len(rss) - 1) / 10)] for i in range(11)],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=48, help="0: the default pool size")
    ap.add_argument("--templates", type=int, default=48)
    ap.add_argument("--abort-rate", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    res = run(args)
    t = res["tally"]
    print(
        f"{t.sent} requests in {res['seconds']:.0f} s from {args.clients} clients "
        f"({t.streamed} streamed): {t.completed} completed, {t.aborted} aborted on purpose, "
        f"{t.server_errors} server errors, {t.client_errors} client errors, "
        f"{t.mismatches} outputs unlike alone; {res['preemptions']:.0f} preemptions"
    )
    print(
        f"after: /health {res['health']}, used blocks 0: {res['free_blocks_ok']}, live matchers "
        f"{res['matchers']:.0f}, request errors {res['request_errors']:.0f}; server RSS "
        f"{res['rss_start_mb']:.0f} MB at start, {res['rss_warm_mb']:.0f} MB after the first "
        f"quarter, {res['rss_end_mb']:.0f} MB at the end"
    )
    series = ", ".join(f"{m:.0f}" for _, m in res["rss_series"])
    print(f"server RSS (MB) at every tenth of the run: {series}")
    for example in t.examples:
        print(f"  e.g. {example}")
    print(
        f"RESULT soak_requests={t.sent} completed={t.completed} aborted={t.aborted} "
        f"server_errors={t.server_errors} mismatches={t.mismatches} "
        f"preemptions={res['preemptions']:.0f} free_blocks_ok={int(res['free_blocks_ok'])} "
        f"rss_growth_mb={res['rss_growth_mb']:.1f}"
    )
    ok = (
        t.server_errors == t.client_errors == t.mismatches == 0
        and res["free_blocks_ok"]
        and res["matchers"] == 0
        and res["health"] == 200
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
