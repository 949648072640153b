"""Web pages and the server (issue 41, finding 5): without an API key, only the server's own
names as Host, its own or listed origins, JSON bodies; CORS for listed origins only. Each
request here is one a browser would send; before these checks, the cross-site one was served."""

from __future__ import annotations

import httpx
import pytest
from web import API_KEY, tiny_serving

from engine.entrypoints.openai.browser import host_name, server_hosts

APP = "http://app.example:3000"  # the one site whose pages may call the server
BODY = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'


@pytest.fixture(scope="module")
def open_server(tiny_llama):
    """No API key; bound to 127.0.0.1; tandem.lan named as a host, APP as an origin."""
    fields = {"bind_host": "127.0.0.1", "allowed_hosts": ("tandem.lan",)}
    with tiny_serving(tiny_llama, **fields, allowed_origins=(APP,)) as served:
        yield served


def post(url: str, headers: dict, body: bytes = BODY) -> httpx.Response:
    return httpx.post(url + "/v1/completions", content=body, headers=headers, timeout=60)


def num_generated(state) -> int:
    return state.engine.snapshot()["num_generated_tokens"]


def test_cross_site_text_plain_post_is_refused(open_server):
    """The finding's request: a page on evil.example posts text/plain (no preflight) after
    rebinding its name to 127.0.0.1. It reaches no handler."""
    url, state = open_server
    before = num_generated(state)
    headers = {
        "Host": "evil.example",
        "Origin": "http://evil.example",
        "Content-Type": "text/plain",
    }
    r = post(url, headers)
    assert r.status_code == 403
    error = r.json()["error"]
    assert error["param"] == "Host" and error["code"] == "host_not_allowed"
    assert "'evil.example'" in error["message"] and "--allowed-hosts" in error["message"]
    assert "access-control-allow-origin" not in r.headers
    assert num_generated(state) == before


@pytest.mark.parametrize(
    "headers, status, param",
    [
        ({"Origin": "http://evil.example", "Content-Type": "application/json"}, 403, "Origin"),
        ({"Origin": "null", "Content-Type": "application/json"}, 403, "Origin"),
        ({"Content-Type": "text/plain"}, 415, "Content-Type"),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
        ({"Content-Type": "multipart/form-data; boundary=x"}, 415, "Content-Type"),
        ({}, 415, "Content-Type"),
    ],
)
def test_other_origins_and_bodies_are_refused(open_server, headers, status, param):
    url, state = open_server
    before = num_generated(state)
    r = post(url, headers)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert num_generated(state) == before


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "LOCALHOST", "tandem.lan"])
def test_own_names_and_json_are_served(open_server, host):
    url, _ = open_server
    port = url.rsplit(":", 1)[1]
    headers = {"Host": f"{host}:{port}", "Content-Type": "application/json; charset=utf-8"}
    r = post(url, headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert "access-control-allow-origin" not in r.headers  # no Origin: no CORS


def test_the_servers_own_page_is_same_origin(open_server):
    """The playground's page posts with Origin = the server's own address: served, no CORS."""
    url, _ = open_server
    r = post(url, {"Origin": url, "Content-Type": "application/json"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_for_a_listed_origin_as_llama_cpp_answers(open_server):
    url, _ = open_server
    r = post(url, {"Origin": APP, "Content-Type": "application/json"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == APP
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["vary"] == "Origin"
    asked = {
        "Origin": APP,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    pre = httpx.options(url + "/v1/completions", headers=asked)
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == APP
    assert pre.headers["access-control-allow-methods"] == "GET, POST"
    assert pre.headers["access-control-allow-headers"] == "authorization, content-type"
    assert pre.headers["access-control-allow-credentials"] == "true"
    evil = httpx.options(url + "/v1/completions", headers=asked | {"Origin": "http://evil.example"})
    assert evil.status_code == 403 and evil.json()["error"]["param"] == "Origin"
    assert "access-control-allow-origin" not in evil.headers


def test_get_routes_check_host_too(open_server):
    """DNS rebinding reads with GET: /v1/models under a foreign Host is refused as well."""
    url, _ = open_server
    r = httpx.get(url + "/v1/models", headers={"Host": "evil.example"})
    assert r.status_code == 403 and r.json()["error"]["param"] == "Host"
    assert httpx.get(url + "/v1/models").status_code == 200


def test_with_an_api_key_the_key_keeps_pages_out(tiny_llama):
    """With a key, Host and Content-Type are not checked (a page cannot learn the key), and
    the cross-site request without it is a 401."""
    with tiny_serving(tiny_llama, api_keys=(API_KEY,)) as (url, state):
        headers = {"Host": "evil.example", "Content-Type": "text/plain"}
        assert post(url, headers).status_code == 401
        keyed = headers | {"Authorization": f"Bearer {API_KEY}"}
        assert post(url, keyed).status_code == 200


def test_server_hosts():
    assert server_hosts("127.0.0.1", ()) == {"localhost", "127.0.0.1", "::1"}
    assert server_hosts("10.1.2.3", ["Tandem.LAN"]) == {
        "localhost",
        "127.0.0.1",
        "::1",
        "10.1.2.3",
        "tandem.lan",
    }
    assert server_hosts("0.0.0.0", ()) == {"localhost", "127.0.0.1", "::1"}  # any: name them
    assert [host_name(h) for h in ("[::1]:8000", "a.b:80", "::1", "x")] == [
        "::1",
        "a.b",
        "::1",
        "x",
    ]
