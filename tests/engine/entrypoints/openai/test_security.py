"""Loading and serving defences: model code never runs (no trust_remote_code), weights only from
safetensors with a clear error for corrupt or missing files, adapters only by configured name
over HTTP, /health turning 503 when the engine loop dies, and deeply nested bodies refused."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from web import serving

from engine import LLM
from engine.config import EngineConfig
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.openai.server import ServerState, build_app
from engine.llm_engine import LLMEngine


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_model_code_is_never_run(tiny_llama, tmp_path):
    """A checkpoint that asks for its own Python (auto_map + a custom model_type) is refused,
    and the module it ships is never imported."""
    d = copy_model(tiny_llama, tmp_path / "remote")
    marker = tmp_path / "ran"
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    config = json.loads((d / "config.json").read_text())
    config.update(
        model_type="evil",
        auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.Evil"},
    )
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception) as err:
        LLM(str(d), num_kv_blocks=16)
    assert "trust_remote_code" in str(err.value) or "evil" in str(err.value)
    assert not marker.exists()


def test_corrupt_weights_name_the_file(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "corrupt")
    weights = next(d.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cannot read weights .*model\.safetensors"):
        LLM(str(d), num_kv_blocks=16)


def test_missing_and_pickled_weights_are_refused(tiny_llama, tmp_path):
    d = copy_model(tiny_llama, tmp_path / "pickled")
    weights = next(d.glob("*.safetensors"))
    weights.rename(d / "pytorch_model.bin")  # what a pickle checkpoint would be called
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights"):
        LLM(str(d), num_kv_blocks=16)
    with pytest.raises(ValueError, match="neither a model directory with config.json"):
        LLM(str(tmp_path / "nowhere"), num_kv_blocks=16)


@pytest.fixture
def tiny_server(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, num_threads=1))
    state = ServerState(AsyncEngine(engine), "tiny", {})
    with serving(build_app(state)) as url:
        yield url, state
    state.engine.shutdown()


@pytest.mark.parametrize(
    "model", ["/etc/passwd", "../../../etc/passwd", "file:///etc/passwd", "tiny/../x"]
)
def test_requests_cannot_name_paths(tiny_server, model):
    """model names only what the server was started with; a path is just an unknown name."""
    url, _ = tiny_server
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "root:" not in r.text


def test_health_turns_503_when_the_loop_dies(tiny_server):
    """A step that raises (a bug, injected) stops the loop: the request in flight gets a 503
    without internals, /health says 503, and so does every later request."""
    url, state = tiny_server
    engine = state.engine.engine

    def broken_step():
        raise RuntimeError("injected step failure at /secret/place")

    engine.step = broken_step
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=30)
    assert r.status_code == 503
    assert "/secret" not in r.text and "injected" not in r.text
    assert httpx.get(url + "/health").status_code == 503
    again = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert again.status_code == 503
    snap = engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]


def _die_after_three_tokens(engine) -> None:
    """A fault injector: the engine's step raises (a bug) once any request holds 3 tokens, so
    a stream dies mid-way whatever the speed of the machine."""
    real = engine.step

    def step():
        if any(r.num_output_tokens >= 3 for g in engine.groups.values() for r in g.requests):
            raise RuntimeError("injected step failure at /secret/place")
        return real()

    engine.step = step


@pytest.mark.parametrize("client", ["httpx", "openai"])
def test_engine_death_while_streaming_is_an_error_event(tiny_server, client):
    """The loop dies after a stream's first tokens: the stream gets OpenAI's error event
    (`data: {"error": ...}`, then [DONE]) without internals, the official client raises
    APIError from it, and /health says 503; never a hang (the client's 30 s timeout only fires
    on one). Fails if a dead engine leaves its streams waiting (ReadTimeout), or closes them
    with no error (a truncated answer that looks whole)."""
    url, state = tiny_server
    _die_after_three_tokens(state.engine.engine)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 200, "stream": True}
    body["extra_body"] = {"ignore_eos": True}
    if client == "openai":
        import openai

        api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        text = ""
        with pytest.raises(openai.APIError) as err:
            for chunk in api.completions.create(**body):
                text += chunk.choices[0].text
        assert text and "the engine stopped" in err.value.message
        assert "/secret" not in err.value.message and "injected" not in err.value.message
    else:
        body |= body.pop("extra_body")
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        *chunks, error = [json.loads(e) for e in events[:-1]]
        assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)
        assert set(error) == {"error"} and error["error"]["type"] == "server_error"
        assert error["error"]["message"] == "the engine stopped after an internal error"
    assert httpx.get(url + "/health").status_code == 503
    snap = state.engine.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]


@pytest.mark.parametrize(
    "depth, status, words",
    [(100, 200, None), (101, 400, "nests 101 levels deep; at most 100"), (100_000, 400, "far")],
)
def test_deeply_nested_json_is_a_400(tiny_server, depth, status, words):
    """Nesting is bounded (100 levels): one past is a clear 400, and so is nesting deep enough
    to overflow the parser's stack (a RecursionError: a 500 before)."""
    url, _ = tiny_server
    inner = "[" * (depth - 2) + "]" * (depth - 2)  # the body and metadata are two levels
    body = '{"model": "tiny", "prompt": "hi", "max_tokens": 1, "metadata": {"x": ' + inner + "}}"
    headers = {"Content-Type": "application/json"}
    r = httpx.post(url + "/v1/completions", content=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text[:300]
    if words:
        assert words in r.json()["error"]["message"]
