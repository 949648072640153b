"""Every documented limit at its boundary (issue 41, point 7): the value at the limit is
served, one past it is refused with the status README gives (400, or 413 for the body), the
error naming the parameter and the value that broke it. The limits of admission control
that depend on what else is held (--max-queued-requests, --max-queued-tokens: a 429) are
tested at their boundary in test_admission.py; control characters in cache_salt in
test_access.py; the 64 KiB constraint's compile in test_grammar_isolation.py.

Two servers on tiny random Llamas: `wide` (the defaults, a vocabulary of 1088 so 1024
logit_bias entries fit, a --lora-dir) and `narrow` (4 sequences, 12 KV blocks, 8 queued
requests and 64 queued tokens), so the limits set by the engine's size bind too."""

from __future__ import annotations

import json

import httpx
import pytest
from web import serving, wait_idle

from engine.config import EngineConfig
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.openai.admission import AdmissionLimits
from engine.entrypoints.openai.server import DEFAULT_MAX_BODY_BYTES, ServerState, build_app
from engine.grammar.compiler import schema_shape
from engine.llm_engine import LLMEngine
from models import make_tiny_model

VOCAB = 1088  # > the 1024 logit_bias entries allowed, each a token id inside the vocabulary
CONTEXT = 512  # the tiny model's max_position_embeddings
NARROW = AdmissionLimits(max_queued_requests=8, max_queued_tokens=64)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("limits"), "llama", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory):
    from models import make_adapter

    folder = tmp_path_factory.mktemp("lora-dir")
    make_adapter(model, folder / "a", 0, 4, ["q_proj"], {})
    return folder


def _server(model, config: dict, **fields):
    engine = LLMEngine(EngineConfig(model=str(model), num_threads=1, **config))
    state = ServerState(AsyncEngine(engine), "tiny", {}, **fields)
    return state, serving(build_app(state))


@pytest.fixture(scope="module")
def servers(model, adapter):
    wide, wide_serving = _server(
        model, {"num_kv_blocks": 256, "enable_lora": True}, lora_dir=adapter
    )
    narrow, narrow_serving = _server(model, {"num_kv_blocks": 12, "max_num_seqs": 4}, limits=NARROW)
    with wide_serving as wide_url, narrow_serving as narrow_url:
        yield {"wide": (wide_url, wide), "narrow": (narrow_url, narrow)}
    wide.engine.shutdown()
    narrow.engine.shutdown()


def _padded_schema(size: int) -> dict:
    """A JSON schema whose text is exactly `size` characters (a long description)."""
    schema = {"type": "string", "description": ""}
    schema["description"] = "x" * (size - len(json.dumps(schema)))
    assert len(json.dumps(schema)) == size
    return schema


def _nested_schema(depth: int) -> dict:
    """A schema nested `depth` levels deep (its `examples` are never compiled)."""
    inner: list = []
    for _ in range(depth - 2):
        inner = [inner]
    schema = {"type": "integer", "examples": inner}
    assert schema_shape(schema)[0] == depth
    return schema


def _wide_schema(num_nodes: int) -> dict:
    """A schema of exactly `num_nodes` JSON values."""
    schema = {"type": "integer", "examples": [0] * (num_nodes - 3)}
    assert schema_shape(schema)[1] == num_nodes
    return schema


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)]


def _schema_format(schema: dict) -> dict:
    spec = {"name": "x", "schema": schema}
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


def _kv_pool_max_tokens(state) -> int:
    """The largest max_tokens a 16-token prompt may ask on this engine's KV pool: its prompt
    block, its output blocks and one more for a fork must fit (Scheduler.check_fits)."""
    usable = state.engine.engine.scheduler.kv.pool.num_usable
    return 16 * (usable - 2)


# (name, server, route, the body at the limit, the body one past it, status, param, value shown)
# Every body also gets {"model": "tiny", "max_tokens": 1} and a prompt (chat: a message) unless
# it gives its own.
CASES = [
    ("n", "wide", "cmpl", {"n": 64}, {"n": 65}, 400, "n", "65"),
    ("n over max_num_seqs", "narrow", "cmpl", {"n": 4}, {"n": 5}, 400, "n", "n=5"),
    ("logprobs", "wide", "cmpl", {"logprobs": 20}, {"logprobs": 21}, 400, "logprobs", "21"),
    (
        "prompt_logprobs",
        "wide",
        "cmpl",
        {"prompt_logprobs": 20},
        {"prompt_logprobs": 21},
        400,
        "prompt_logprobs",
        "21",
    ),
    (
        "top_logprobs",
        "wide",
        "chat",
        {"logprobs": True, "top_logprobs": 20},
        {"logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        "21",
    ),
    ("n_probs", "wide", "cmpl", {"n_probs": 20}, {"n_probs": 21}, 400, "n_probs", "21"),
    ("seed high", "wide", "cmpl", {"seed": 2**63 - 1}, {"seed": 2**63}, 400, "seed", str(2**63)),
    (
        "seed low",
        "wide",
        "cmpl",
        {"seed": -(2**63)},
        {"seed": -(2**63) - 1},
        400,
        "seed",
        str(-(2**63) - 1),
    ),
    (
        "stop strings",
        "wide",
        "cmpl",
        {"stop": [f"s{i}" for i in range(64)]},
        {"stop": [f"s{i}" for i in range(65)]},
        400,
        "stop",
        "got 65",
    ),
    (
        "stop length",
        "wide",
        "cmpl",
        {"stop": ["x" * 1024]},
        {"stop": ["x" * 1025]},
        400,
        "stop",
        "longest 1025",
    ),
    (
        "stop_token_ids",
        "wide",
        "cmpl",
        {"stop_token_ids": [1] * 1024},
        {"stop_token_ids": [1] * 1025},
        400,
        "stop_token_ids",
        "got 1025",
    ),
    (
        "stop_token_ids vocabulary",
        "wide",
        "cmpl",
        {"stop_token_ids": [VOCAB - 1]},
        {"stop_token_ids": [VOCAB]},
        400,
        "stop_token_ids",
        str(VOCAB),
    ),
    (
        "logit_bias entries",
        "wide",
        "cmpl",
        {"logit_bias": {str(i): 0.5 for i in range(1024)}},
        {"logit_bias": {str(i): 0.5 for i in range(1025)}},
        400,
        "logit_bias",
        "got 1025",
    ),
    (
        "logit_bias vocabulary",
        "wide",
        "cmpl",
        {"logit_bias": {str(VOCAB - 1): 1}},
        {"logit_bias": {str(VOCAB): 1}},
        400,
        "logit_bias",
        str(VOCAB),
    ),
    (
        "logit_bias high",
        "wide",
        "cmpl",
        {"logit_bias": {"5": 100}},
        {"logit_bias": {"5": 100.5}},
        400,
        "logit_bias",
        "100.5",
    ),
    (
        "logit_bias low",
        "wide",
        "cmpl",
        {"logit_bias": {"5": -100}},
        {"logit_bias": {"5": -100.5}},
        400,
        "logit_bias",
        "-100.5",
    ),
    (
        "num_speculative_tokens",
        "wide",
        "cmpl",
        {"num_speculative_tokens": 15},
        {"num_speculative_tokens": 16},
        400,
        "num_speculative_tokens",
        "16",
    ),
    (
        "temperature",
        "wide",
        "cmpl",
        {"temperature": 999_999.0},
        {"temperature": 1e6},
        400,
        "temperature",
        "1000000.0",
    ),
    (
        "repetition_penalty",
        "wide",
        "cmpl",
        {"repetition_penalty": 100},
        {"repetition_penalty": 100.5},
        400,
        "repetition_penalty",
        "100.5",
    ),
    (
        "presence_penalty",
        "wide",
        "cmpl",
        {"presence_penalty": 2},
        {"presence_penalty": 2.5},
        400,
        "presence_penalty",
        "2.5",
    ),
    (
        "frequency_penalty",
        "wide",
        "cmpl",
        {"frequency_penalty": -2},
        {"frequency_penalty": -2.5},
        400,
        "frequency_penalty",
        "-2.5",
    ),
    (
        "min_tokens",
        "wide",
        "cmpl",
        {"min_tokens": 3, "max_tokens": 3},
        {"min_tokens": 4, "max_tokens": 3},
        400,
        "min_tokens",
        "got 4",
    ),
    (
        "max_tokens within the context",
        "wide",
        "cmpl",
        {"prompt": [5] * 12, "max_tokens": CONTEXT - 12},
        {"prompt": [5] * 12, "max_tokens": CONTEXT - 11},
        400,
        "max_tokens",
        f"max_tokens={CONTEXT - 11}",
    ),
    (
        "prompt within the context",
        "wide",
        "cmpl",
        {"prompt": [5] * (CONTEXT - 1)},
        {"prompt": [5] * CONTEXT},
        400,
        "prompt",
        f"prompt has {CONTEXT} tokens",
    ),
    (
        "chat prompt within the context",
        "wide",
        "chat",
        # the template adds "<user>" and "\n<assistant>" (18 byte tokens) around the content
        {"messages": [{"role": "user", "content": "x" * (CONTEXT - 19)}]},
        {"messages": [{"role": "user", "content": "x" * (CONTEXT - 18)}]},
        400,
        "messages",
        f"prompt has {CONTEXT} tokens",
    ),
    (
        "max_tokens within the KV pool",
        "narrow",
        "cmpl",
        {"prompt": [5] * 16, "max_tokens": "KV"},
        {"prompt": [5] * 16, "max_tokens": "KV+1"},
        400,
        "max_tokens",
        "max_tokens=KV+1",
    ),
    (
        "constraint size",
        "wide",
        "cmpl",
        _schema_format(_padded_schema(65536)),
        _schema_format(_padded_schema(65537)),
        400,
        "response_format",
        "65537 characters",
    ),
    (
        "schema depth",
        "wide",
        "cmpl",
        {"structured_outputs": {"json": _nested_schema(64)}},
        {"structured_outputs": {"json": _nested_schema(65)}},
        400,
        "structured_outputs",
        "nested 65 levels deep",
    ),
    (
        "schema values",
        "wide",
        "cmpl",
        {"guided_json": _wide_schema(8192)},
        {"guided_json": _wide_schema(8193)},
        400,
        "guided_json",
        "has 8193 JSON values",
    ),
    (
        "tools",
        "wide",
        "chat",
        {"tools": _tools(128), "tool_choice": "none"},
        {"tools": _tools(129), "tool_choice": "none"},
        400,
        "tools",
        "got 129",
    ),
    (
        "prompts per request",
        "wide",
        "cmpl",
        {"prompt": [[5]] * 256},
        {"prompt": [[5]] * 257},
        400,
        "prompt",
        "holds 257 prompts",
    ),
    (
        "prompts x n within --max-queued-requests",
        "narrow",
        "cmpl",
        {"prompt": [[5], [6]], "n": 4},
        {"prompt": [[5], [6], [7]], "n": 3},
        400,
        "n",
        "9 requests",
    ),
    (
        "prompt tokens within --max-queued-tokens",
        "narrow",
        "cmpl",
        {"prompt": [5] * 64},
        {"prompt": [5] * 65},
        400,
        "prompt",
        "hold 65 tokens",
    ),
    (
        "cache_salt",
        "wide",
        "cmpl",
        {"cache_salt": "s" * 1024},
        {"cache_salt": "s" * 1025},
        400,
        "cache_salt",
        "1025",
    ),
    (
        "prediction",
        "wide",
        "cmpl",
        {"prediction": {"type": "content", "content": "a" * 32768}},
        {"prediction": {"type": "content", "content": "a" * 32769}},
        400,
        "prediction",
        "32769 tokens",
    ),
    (
        "beam width",
        "wide",
        "cmpl",
        {"use_beam_search": True, "n": 10, "temperature": 0},
        {"use_beam_search": True, "n": 11, "temperature": 0},
        400,
        "n",
        "beam_width=11",
    ),
    (
        "beam width as best_of",
        "wide",
        "cmpl",
        {"use_beam_search": True, "best_of": 10, "temperature": 0},
        {"use_beam_search": True, "best_of": 11, "temperature": 0},
        400,
        "best_of",
        "beam_width=11",
    ),
    (
        "detokenize ids",
        "wide",
        "detok",
        {"tokens": [0, VOCAB - 1]},
        {"tokens": [0, VOCAB]},
        400,
        "tokens",
        str(VOCAB),
    ),
    (
        "hot-loaded adapter name",
        "wide",
        "load",
        {"lora_name": "n" * 64, "lora_path": "a"},
        {"lora_name": "n" * 65, "lora_path": "a"},
        400,
        "lora_name",
        "n" * 65,
    ),
]
ROUTES = {
    "cmpl": "/v1/completions",
    "chat": "/v1/chat/completions",
    "detok": "/detokenize",
    "load": "/v1/load_lora_adapter",
}


def _body(route: str, fields: dict, state) -> dict:
    if route == "detok":
        return dict(fields)
    if route == "load":
        return dict(fields)
    base = {"model": "tiny", "max_tokens": 1}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    base |= chat if route == "chat" else {"prompt": "hi"}
    body = base | fields
    if isinstance(body["max_tokens"], str):  # "KV" / "KV+1": the KV pool's own limit
        most = _kv_pool_max_tokens(state)
        body["max_tokens"] = most + (1 if body["max_tokens"].endswith("+1") else 0)
    return body


def _post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(url + ROUTES[route], json=body, timeout=120)


@pytest.mark.parametrize(
    "server, route, at, past, status, param, shown",
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_limit_at_and_one_past(servers, server, route, at, past, status, param, shown):
    url, state = servers[server]
    served = _post(url, route, _body(route, at, state))
    assert served.status_code == 200, served.text[:500]
    refused = _post(url, route, _body(route, past, state))
    assert refused.status_code == status, refused.text[:500]
    error = refused.json()["error"]
    if "KV" in shown:
        shown = shown.replace("KV+1", str(_kv_pool_max_tokens(state) + 1))
    assert error["param"] == param, error
    assert shown in error["message"], error
    if route == "load":  # the one served is loaded: unload it (the next test counts them)
        name = at["lora_name"]
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name})
        assert r.status_code == 200, r.text
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]
    assert state.admission.num_requests == state.admission.num_tokens == 0


def test_adapters_listed_at_most_64(servers):
    """64 hot-loaded adapters are served and listed; the 65th load is refused, naming
    lora_name, the count and the name."""
    url, state = servers["wide"]
    assert state.max_adapters == 64
    names = [f"a{i}" for i in range(64)]
    try:
        for name in names:
            body = {"lora_name": name, "lora_path": "a"}
            r = httpx.post(url + "/v1/load_lora_adapter", json=body)
            assert r.status_code == 200, r.text
        listed = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["tiny", *names]
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a64", "lora_path": "a"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "lora_name"
        assert error["message"] == "64 adapters are loaded, this server's most: 'a64' is not"
    finally:
        for name in list(state.adapters):
            httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name})
    assert state.adapters == {}


def _exact_body(size: int) -> bytes:
    """A served completions body of exactly `size` bytes (the bulk in an ignored field)."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "metadata": {"pad": ""}}
    pad = size - len(json.dumps(body).encode())
    body["metadata"]["pad"] = "x" * pad
    raw = json.dumps(body).encode()
    assert len(raw) == size
    return raw


def test_body_size_at_and_one_past_the_limit(servers):
    """--max-body-bytes (4 MiB by default): a body of exactly that many bytes is served; one
    byte more is a 413 naming the limit and the body's size, declared or streamed."""
    url, _ = servers["wide"]
    headers = {"Content-Type": "application/json"}
    at = _exact_body(DEFAULT_MAX_BODY_BYTES)
    r = httpx.post(url + "/v1/completions", content=at, headers=headers, timeout=120)
    assert r.status_code == 200, r.text[:300]
    past = _exact_body(DEFAULT_MAX_BODY_BYTES + 1)
    r = httpx.post(url + "/v1/completions", content=past, headers=headers, timeout=120)
    assert r.status_code == 413
    message = r.json()["error"]["message"]
    assert f"is {DEFAULT_MAX_BODY_BYTES + 1} bytes" in message and "--max-body-bytes" in message

    def chunks(raw: bytes):  # no content-length: counted as it streams
        for i in range(0, len(raw), 1 << 16):
            yield raw[i : i + (1 << 16)]

    r = httpx.post(url + "/v1/completions", content=chunks(at), headers=headers, timeout=120)
    assert r.status_code == 200, r.text[:300]
    r = httpx.post(url + "/v1/completions", content=chunks(past), headers=headers, timeout=120)
    assert r.status_code == 413
    message = r.json()["error"]["message"]
    assert f"runs over {DEFAULT_MAX_BODY_BYTES} bytes" in message and "--max-body-bytes" in message


@pytest.mark.parametrize("depth, status", [(100, 200), (101, 400)])
def test_body_nesting_at_and_one_past_the_limit(servers, depth, status):
    url, _ = servers["wide"]
    inner = "[" * (depth - 2) + "]" * (depth - 2)  # the body and metadata are two levels
    body = '{"model": "tiny", "prompt": "hi", "max_tokens": 1, "metadata": {"x": ' + inner + "}}"
    headers = {"Content-Type": "application/json"}
    r = httpx.post(url + "/v1/completions", content=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text[:300]
    if status == 400:
        assert "nests 101 levels deep; at most 100" in r.json()["error"]["message"]
