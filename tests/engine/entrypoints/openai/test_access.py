"""The API key on every route that does work or shows state (issue 41, finding 6), the
/login cookie browsers use, and per-key prefix caches (finding 4): each test here failed on
the server before (the playground, /metrics, /v1/snapshot and /openapi.json answered anyone;
every key-holder shared one prefix cache and read its hits in usage)."""

from __future__ import annotations

import httpx
import pytest
from web import API_KEY, serving, tiny_serving, wait_idle

from engine.config import EngineConfig
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.openai.middleware import KEY_COOKIE
from engine.entrypoints.openai.server import ServerState, build_app
from engine.llm_engine import LLMEngine
from playground.ui import mount_playground

OTHER_KEY = "tenant-b-key"
BEARER = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def keyed_playground(tiny_llama):
    """The tiny model with the playground mounted, behind two keys."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, num_threads=1))
    state = ServerState(AsyncEngine(engine), "tiny", {}, api_keys=(API_KEY, OTHER_KEY))
    with serving(mount_playground(build_app(state), state)) as url:
        yield url, state
    state.engine.shutdown()


ROUTES = [
    ("GET", "/"),
    ("GET", "/config"),
    ("GET", "/gradio_api/info"),
    ("POST", "/gradio_api/call/generate"),
    ("POST", "/gradio_api/queue/join"),
    ("GET", "/v1/snapshot"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/tokenize"),
]


@pytest.mark.parametrize("method, path", ROUTES)
def test_every_route_needs_the_key(keyed_playground, method, path):
    url, _ = keyed_playground
    body = {"data": []} if "gradio" in path else {"prompt": "hi", "max_tokens": 1}
    json_body = body if method == "POST" else None
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Cookie": f"{KEY_COOKIE}=wrong"}):
        r = httpx.request(method, url + path, json=json_body, headers=headers, timeout=60)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
        assert r.json()["error"]["code"] == "invalid_api_key"
    if method == "GET":
        for key in (API_KEY, OTHER_KEY):
            r = httpx.get(url + path, headers={"Authorization": f"Bearer {key}"}, timeout=60)
            assert r.status_code == 200, (path, r.text[:200])


def test_health_needs_no_key(keyed_playground):
    url, _ = keyed_playground
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_login_sets_a_strict_cookie_that_opens_the_playground(keyed_playground):
    url, _ = keyed_playground
    assert "API key" in httpx.get(url + "/login").text
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    wrong = httpx.post(url + "/login", content=b"key=nope", headers=form)
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    cross = httpx.post(
        url + "/login", content=f"key={API_KEY}", headers=form | {"Origin": "http://evil.example"}
    )
    assert cross.status_code == 403 and "set-cookie" not in cross.headers
    r = httpx.post(url + "/login", content=f"key={API_KEY}", headers=form)
    assert r.status_code == 303 and r.headers["location"] == "/"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{KEY_COOKIE}=") and API_KEY not in cookie
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    token = cookie.split(";")[0].split("=", 1)[1]
    page = httpx.get(url + "/", headers={"Cookie": f"{KEY_COOKIE}={token}"})
    assert page.status_code == 200 and "gradio" in page.text.lower()
    as_bearer = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {token}"})
    assert as_bearer.status_code == 401  # the cookie's token is no bearer key


def test_gradio_client_with_the_key(keyed_playground):
    """The playground's API as a script calls it: with the key it generates, without it no."""
    from gradio_client import Client

    url, state = keyed_playground
    with pytest.raises(Exception):  # noqa: B017 (gradio_client raises its own kinds)
        Client(url + "/", verbose=False)
    client = Client(url + "/", verbose=False, headers=BEARER)
    args = ["completion", "abc abc abc", 0.0, 1.0, 0, 6, -1, "off", 4, True, "(base model)"]
    html, stats, _ = client.predict(*args, "none", "", "", "none", "", [], api_name="/generate")
    assert "finished" in stats and 'class="tk' in html
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]


PROMPT = list(range(3, 3 + 40))  # two full blocks of 16 and a tail


def complete(url: str, key: str, **extra) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, **extra}
    headers = {"Authorization": f"Bearer {key}"}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_each_key_has_its_own_prefix_cache(tiny_llama):
    """Tenants share no KV unless their requests give the same cache_salt."""
    keys = (API_KEY, OTHER_KEY)
    with tiny_serving(tiny_llama, api_keys=keys, show_cached_tokens=True) as (url, state):

        def cached(key: str, **extra) -> int:
            return complete(url, key, **extra)["prompt_tokens_details"]["cached_tokens"]

        assert cached(API_KEY) == 0
        assert cached(API_KEY) == 32  # the same key: its own cache
        assert cached(OTHER_KEY) == 0  # another key: not the first one's
        assert cached(API_KEY, cache_salt="shared") == 0
        assert cached(OTHER_KEY, cache_salt="shared") == 32  # the same salt, given: shared


def test_a_beam_search_caches_under_its_keys_salt(tiny_llama):
    """A beam search's KV is its key's too: after one, the same key's request finds the prompt
    cached and another key's does not (the beams once ran unsalted: a cache every key shared,
    and the searching key's own requests missed it)."""
    with tiny_serving(tiny_llama, api_keys=(API_KEY, OTHER_KEY), show_cached_tokens=True) as (
        url,
        state,
    ):
        beams = dict(use_beam_search=True, best_of=2, max_tokens=2, temperature=0)
        body = {"model": "tiny", "prompt": PROMPT, **beams}
        r = httpx.post(url + "/v1/completions", json=body, headers=BEARER, timeout=60)
        assert r.status_code == 200, r.text
        wait_idle(state.engine)
        usage = [complete(url, key)["prompt_tokens_details"]["cached_tokens"]
                 for key in (OTHER_KEY, API_KEY)]  # fmt: skip
        assert usage == [0, 32]


def test_cached_tokens_only_with_the_server_flag(tiny_llama):
    with tiny_serving(tiny_llama, api_keys=(API_KEY,)) as (url, state):
        complete(url, API_KEY)
        usage = complete(url, API_KEY)
        assert usage == {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}
        assert state.engine.snapshot()["prefix_cache"]["hit_tokens"] == 32  # (a hit, unshown)
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=BEARER) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert '"usage"' in lines[-1] and "cached_tokens" not in lines[-1]


@pytest.mark.parametrize("salt", ["\u0000lora:x@1", "a\nb", "\u007f", "x" * 1025])
def test_bad_cache_salt_is_a_400_naming_it(tiny_llama, salt):
    with tiny_serving(tiny_llama) as (url, _):
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "cache_salt": salt}
        r = httpx.post(url + "/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        assert "cache_salt" in r.json()["error"]["message"]


def test_env_keys_are_tenants_with_their_own_caches(tiny_llama, monkeypatch):
    """$TANDEM_API_KEY takes several keys, comma-separated, as the flag repeated: `tandem
    serve`'s own state has each as a key of its own, each opens the server, and each key's
    requests get its own default cache salt. The flags, when given, win."""
    import argparse

    from playground.launch import add_server_args, api_keys, build_state

    monkeypatch.setenv("TANDEM_API_KEY", f" {API_KEY}, {OTHER_KEY},,{API_KEY}")
    assert api_keys([]) == (API_KEY, OTHER_KEY)
    assert api_keys(["flag-key"]) == ("flag-key",)
    parser = argparse.ArgumentParser()
    add_server_args(parser, 0)
    flags = ["--model", str(tiny_llama), "--served-model-name", "tiny", "--threads", "1"]
    args = parser.parse_args(flags)
    state = build_state(args, {})
    try:
        assert state.api_keys == (API_KEY, OTHER_KEY)
        state.show_cached_tokens = True
        with serving(build_app(state)) as url:

            def cached(key: str) -> int:
                return complete(url, key)["prompt_tokens_details"]["cached_tokens"]

            assert [cached(API_KEY), cached(API_KEY), cached(OTHER_KEY)] == [0, 32, 0]
            assert cached(OTHER_KEY) == 32
            whole = {"Authorization": f"Bearer {API_KEY},{OTHER_KEY}"}  # the variable's text
            assert httpx.get(url + "/v1/models", headers=whole).status_code == 401
    finally:
        state.engine.shutdown()


PLAYGROUND_PROMPT = "The playground and the API share a prefix cache, key by key."


def test_playground_requests_get_the_signed_in_keys_salt(keyed_playground, monkeypatch):
    """The playground's generate and load test run under the cache salt of the key they came
    with (bearer or /login cookie), as that key's API requests do: the same key's API request
    reads the playground's blocks, the other key's does not (before, every playground request
    went in unsalted: one cache shared by every tenant and key-less prefix)."""
    from gradio_client import Client

    from engine.entrypoints.openai.middleware import tenant_salt

    url, state = keyed_playground
    salts: list[str | None] = []
    real = state.engine.add_request

    async def add_request(*args, **kwargs):
        salts.append(kwargs.get("cache_salt"))
        return await real(*args, **kwargs)

    monkeypatch.setattr(state.engine, "add_request", add_request)
    form = ["completion", PLAYGROUND_PROMPT, 0.0, 1.0, 0, 2, -1, "off", 4, True, "(base model)"]
    form += ["none", "", "", "none", "", []]  # ..., tools, tool choice, prediction, chat
    ours = Client(url + "/", verbose=False, headers=BEARER)
    ours.predict(*form, api_name="/generate")
    assert salts == [tenant_salt(API_KEY.encode())]
    wait_idle(state.engine)

    def hits_after(key: str) -> int:
        before = state.engine.snapshot()["prefix_cache"]["hit_tokens"]
        body = {"model": "tiny", "prompt": PLAYGROUND_PROMPT, "max_tokens": 1}
        headers = {"Authorization": f"Bearer {key}"}
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return state.engine.snapshot()["prefix_cache"]["hit_tokens"] - before

    assert hits_after(OTHER_KEY) == 0
    assert hits_after(API_KEY) == 48  # the prompt's three full blocks, from the playground's run
    form_headers = {"Content-Type": "application/x-www-form-urlencoded"}
    login = httpx.post(url + "/login", content=f"key={OTHER_KEY}", headers=form_headers)
    cookie = login.headers["set-cookie"].split(";")[0]
    salts.clear()
    theirs = Client(url + "/", verbose=False, headers={"Cookie": cookie})
    theirs.predict(*form, api_name="/generate")
    theirs.predict(2, api_name="/load_test")
    assert salts == [tenant_salt(OTHER_KEY.encode())] * 3
    with pytest.raises(Exception, match="greater than maximum value 32"):  # noqa: B017
        ours.predict(33, api_name="/load_test")
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]
