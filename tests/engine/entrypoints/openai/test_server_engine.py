"""The server over tiny models: concurrent clients, a request whose processing fails, bad adapter
paths, a draft-model server, and the command line started as a process."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from web import API_KEY, command_line, make_state, serving, wait_idle

from engine import LLM, SamplingParams
from engine.entrypoints.openai.server import build_app
from lora.adapter import LoRARequest


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    state = make_state(str(tiny_llama), num_kv_blocks=1024, max_num_batched_tokens=512)
    with serving(build_app(state)) as url:
        yield url, state
    state.engine.shutdown()


def test_50_concurrent_requests_equal_each_alone(tiny):
    """50 clients at once (greedy, mixed lengths) get what each gets alone, and the engine
    batched them (far fewer steps than the requests one by one)."""
    url, state = tiny
    engine = state.engine.engine
    prompts = [
        bytes((i * 7 + j) % 200 + 32 for j in range(5 + i % 17)).decode("latin-1")
        for i in range(50)
    ]
    prompts = [p.encode("utf-8", "ignore").decode("utf-8", "ignore") or "x" for p in prompts]

    async def ask(c: openai.AsyncOpenAI, i: int) -> str:
        r = await c.completions.create(
            model=str(state.model_name), prompt=prompts[i], max_tokens=8 + i % 9, temperature=0
        )
        return r.choices[0].text

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0) as c:
            return await asyncio.gather(*(ask(c, i) for i in range(50)))

    steps = engine.num_steps
    together = asyncio.run(all_at_once())
    steps_together = engine.num_steps - steps

    async def one_by_one() -> list[str]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0) as c:
            return [await ask(c, i) for i in range(50)]

    steps = engine.num_steps
    alone = asyncio.run(one_by_one())
    steps_alone = engine.num_steps - steps
    assert together == alone
    assert steps_together * 4 < steps_alone, (steps_together, steps_alone)
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_a_request_whose_processing_fails_gets_a_500_alone(tiny):
    """A fault inside one request's processing (its detokenizer raises; injected for requests
    with seed 4242): that request gets a 500 (whole) or an error event (streamed) whose message
    names the part, not the internals; concurrent requests get their usual outputs; the engine
    keeps serving and ends idle with every block free."""
    url, state = tiny
    engine = state.engine.engine
    real_add = engine.add_request

    def add_request(request_id, prompt, params, *args, **kw):
        real_add(request_id, prompt, params, *args, **kw)
        if params.seed == 4242:

            def add_token(token, may_stop):
                raise RuntimeError("injected fault /secret/path")

            engine.groups[request_id].detokenizers[0].add_token = add_token

    kw = dict(model=str(state.model_name), max_tokens=6, temperature=0)
    prompts = ["hello there", "abc", "the quick brown fox", "x y z"]
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        alone = [
            http.post("/v1/completions", json={**kw, "prompt": p}).json()["choices"][0]["text"]
            for p in prompts
        ]
        engine.add_request = add_request
        try:

            async def together():
                async with httpx.AsyncClient(base_url=url, headers=http.headers) as c:
                    normal = [c.post("/v1/completions", json={**kw, "prompt": p}) for p in prompts]
                    bad = c.post("/v1/completions", json={**kw, "prompt": "boom", "seed": 4242})
                    bad_stream = c.post(
                        "/v1/completions",
                        json={**kw, "prompt": "boom", "seed": 4242, "stream": True},
                    )
                    return await asyncio.gather(bad, bad_stream, *normal)

            bad, bad_stream, *normal = asyncio.run(together())
        finally:
            engine.add_request = real_add
        assert bad.status_code == 500
        message = bad.json()["error"]["message"]
        assert "detokenizer" in message and "/secret" not in message and "Traceback" not in message
        assert bad_stream.status_code == 200
        events = [e for e in bad_stream.text.split("\n\n") if e.startswith("data: {")]
        error = json.loads(events[-1][6:])["error"]
        assert "detokenizer" in error["message"] and "/secret" not in error["message"]
        assert bad_stream.text.rstrip().endswith("data: [DONE]")
        assert [r.json()["choices"][0]["text"] for r in normal] == alone
        assert http.get("/health").status_code == 200
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"] and snap["num_request_errors"] == 2


def test_unknown_adapter_path_fails_at_start(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="adapter"):
        make_state(
            str(tiny_llama),
            {"x": LoRARequest("x", str(tmp_path / "missing"))},
            num_kv_blocks=64,
            enable_lora=True,
        )


@pytest.fixture(scope="module")
def tiny_draft(tiny_llama, draft_model):
    state = make_state(
        str(tiny_llama), num_kv_blocks=256, draft_model=str(draft_model), draft_quantization=None
    )
    with serving(build_app(state)) as url:
        yield url, state
    state.engine.shutdown()


def test_draft_model_server_is_lossless(tiny_draft, tiny_llama):
    url, state = tiny_draft
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    ref = LLM(str(tiny_llama), num_kv_blocks=256)
    for prompt in ["abcabcabc", "hello world", "zz"]:
        r = client.completions.create(
            model=state.model_name,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"num_speculative_tokens": 3},
        )
        want = ref.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        assert r.choices[0].text == want[0].outputs[0].text
    assert state.engine.snapshot()["speculation"]["num_drafts"] > 0


@pytest.mark.parametrize("command", ["serve", "playground"])
def test_a_taken_port_fails_before_the_model_loads(tmp_path, command):
    """The server binds its port first: a taken --port ends the command at once with an error
    naming the port, before the (here missing) model is looked at."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [sys.executable, "-m", "playground.cli", command, "--port", str(port)]
        args += ["--model", str(tmp_path / "no-such-model")]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "no-such-model" not in done.stderr


@pytest.mark.parametrize("command", ["serve", "playground"])
def test_command_line_starts_and_answers(tiny_llama, command):
    """`tandem serve` / `tandem playground` as a user starts them: a process on a free port."""
    with command_line(command, str(tiny_llama)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        models = [m.id for m in client.models.list().data]
        assert models[0] == str(tiny_llama)
        if command == "playground":  # the UI at / and the demo adapters as models
            assert httpx.get(url + "/").status_code == 401  # the key covers the playground
            keyed = httpx.get(url + "/", headers={"Authorization": f"Bearer {API_KEY}"})
            assert keyed.status_code == 200
            assert models[1:] == ["demo-lora-a", "demo-lora-b"]
        r = client.completions.create(model=models[-1], prompt="abc", max_tokens=4)
        assert r.usage.completion_tokens == 4
