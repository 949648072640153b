"""The playground on a server shared by several API keys (issue 41, "Safe to expose"): the
page takes no more work than the OpenAI routes would (their admission control, their
messages), and each key's live views show its own requests alone. Both failed before: the
playground's generate, race and load test went past --max-queued-requests unchecked, and every
key's views (the Gradio API's /views, /v1/snapshot) listed every tenant's requests and blocks.

A tiny Llama (one byte per token) behind two keys, holding at most 2 requests and 300 prompt
tokens. Requests are held in the server without timing: by holding the engine's lock (they
wait for their turn, admitted), or by an output observer that stops the engine's loop at a
request's first output (running, its blocks in its table; snapshots still answer)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from web import API_KEY, assert_all_returned, engine_held, serving, until, wait_idle

from engine.config import EngineConfig
from engine.entrypoints.async_engine import AsyncEngine, OutputObserver
from engine.entrypoints.openai.admission import AdmissionLimits
from engine.entrypoints.openai.server import ServerState, build_app
from engine.llm_engine import LLMEngine
from playground.ui import mount_playground

OTHER_KEY = "tenant-b-key"
LIMITS = AdmissionLimits(max_queued_requests=2, max_queued_tokens=300)
FULL = (
    "the server holds 2 requests and takes at most 2 (--max-queued-requests); this one adds 1: "
    "retry after 1 s"
)


@pytest.fixture(scope="module")
def shared(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, num_threads=1))
    keys = (API_KEY, OTHER_KEY)
    state = ServerState(AsyncEngine(engine), "tiny", {}, api_keys=keys, limits=LIMITS)
    with serving(mount_playground(build_app(state), state)) as url:
        yield url, state
    state.engine.shutdown()


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def client(url: str, key: str, cookie: bool = False):
    """The playground's Gradio API as a script calls it: a bearer key, or the /login cookie a
    browser signs in with."""
    from gradio_client import Client

    if not cookie:
        return Client(url + "/", verbose=False, headers=bearer(key))
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    login = httpx.post(url + "/login", content=f"key={key}", headers=form)
    cookie = login.headers["set-cookie"].split(";")[0]
    return Client(url + "/", verbose=False, headers={"Cookie": cookie})


def form(prompt: str, max_tokens: int = 4) -> list:
    """The generate / race form (completion mode, greedy, no speculation) and an empty chat."""
    args = ["completion", prompt, 0.0, 1.0, 0, max_tokens, -1, "off", 4, True, "(base model)"]
    return [*args, "none", "", "", "none", "", []]


def refused(call) -> str:
    """The message of the gr.Error a Gradio API call raised."""
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError) as error:
        call()
    return str(error.value)


def test_the_playground_takes_no_more_than_the_api(shared):
    """Past --max-queued-tokens / --max-queued-requests the page's generate, race and load test
    are refused with the API's message (naming the flag), for every key, while the API's 429
    still answers; a load test takes what fits and says what it sent; nothing stays held."""
    url, state = shared
    ours, theirs = client(url, API_KEY), client(url, OTHER_KEY, cookie=True)
    assert refused(lambda: ours.predict(*form("x" * 301), api_name="/generate")) == (
        "the request's prompts hold 301 tokens; the server takes at most 300 at once "
        "(--max-queued-tokens)"
    )
    with engine_held(state):
        long = ours.submit(*form("a" * 200), api_name="/generate")
        until(lambda: state.admission.num_tokens == 200, "the 200-token prompt is held")
        past_tokens = refused(lambda: ours.predict(*form("b" * 101), api_name="/generate"))
        assert past_tokens == (
            "the server holds 200 prompt tokens and takes at most 300 (--max-queued-tokens); "
            "this request adds 101: retry after 1 s"
        )
        short = ours.submit(*form("abc"), api_name="/generate")
        until(lambda: state.admission.num_requests == 2, "two requests held")
        assert refused(lambda: ours.predict(*form("abc"), api_name="/generate")) == FULL
        assert refused(lambda: theirs.predict(*form("abc"), api_name="/generate")) == FULL
        assert refused(lambda: ours.predict(*form("abc"), api_name="/race")) == FULL
        assert refused(lambda: ours.predict(4, api_name="/load_test")) == (
            f"load test: none of 4 requests sent: {FULL}"
        )
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 1}
        r = httpx.post(url + "/v1/completions", json=body, headers=bearer(API_KEY), timeout=60)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == {
            "message": FULL,
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
        assert state.admission.num_refused == 6
        assert (state.admission.num_requests, state.admission.num_tokens) == (2, 203)
        assert not state.engine.engine.groups  # (held in the server: none reached the engine)
    assert "finished" in long.result()[1] and "finished" in short.result()[1]
    assert_all_returned(state)
    # A load test asked for 4 with one place left: it sends 1 and says why the rest did not go.
    with engine_held(state):
        held = ours.submit(*form("abc"), api_name="/generate")
        until(lambda: state.admission.num_requests == 1, "one request held")
        load = ours.submit(4, api_name="/load_test")
        until(lambda: state.admission.num_requests == 2, "the load test's one request held")
    summary = load.result()
    assert summary.startswith("load test: 1/1 requests finished"), summary
    assert summary.endswith(f"; 3 of 4 not sent: {FULL}"), summary
    assert "finished" in held.result()[1]
    assert_all_returned(state)


class Pause(OutputObserver):
    """Stops the engine's loop at the first output it is handed (on the loop's thread, outside
    the engine's lock, so snapshots still answer) until released: that request stays running,
    its blocks in its table."""

    def __init__(self):
        self.reached, self.go = threading.Event(), threading.Event()

    def on_output(self, out, now: float) -> None:
        if not self.reached.is_set():
            self.reached.set()
            self.go.wait(60)


@contextmanager
def paused(state):
    pause = Pause()
    state.engine.observers.append(pause)
    try:
        yield pause
    finally:
        pause.go.set()
        state.engine.observers.remove(pause)


def views(gradio) -> str:
    """Everything the Gradio API's /views answers (blocks, sharing, speculation, adapters)."""
    return "".join(gradio.predict(api_name="/views"))


def snapshot(url: str, key: str) -> dict:
    r = httpx.get(url + "/v1/snapshot", headers=bearer(key), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


SECRET_A = "zebra quartz violin"  # one token per byte: the whole prompt is in the text's tail
SECRET_B = "mango kettle harbor"


def test_each_key_sees_its_own_requests_and_counts_of_the_rest(shared):
    """A's running playground request: A's views and snapshot hold its id, its text and its
    blocks; B's hold none of them (no request, no block, no hash), only the pool's counts.
    Then B's request over the API: B sees it, A does not."""
    url, state = shared
    ours, theirs = client(url, API_KEY), client(url, OTHER_KEY, cookie=True)
    tokenizer = state.tokenizer
    with paused(state) as pause:
        job = ours.submit(*form(SECRET_A, max_tokens=8), api_name="/generate")
        assert pause.reached.wait(60)
        whole = state.engine.snapshot()  # (what the server holds: the views' source)
        our_views, their_views = views(ours), views(theirs)
        our_snap, their_snap = snapshot(url, API_KEY), snapshot(url, OTHER_KEY)
    (rid,) = [r["request_id"] for r in whole["requests"]]
    assert rid.startswith("ui-") and whole["num_used_blocks"] > 0
    for leaked in (rid, SECRET_A):
        assert leaked not in their_views and leaked not in json.dumps(their_snap)
    assert their_snap["requests"] == [] and their_snap["blocks"] == {}
    assert set(their_snap) == set(whole)  # every count is there
    assert their_snap["num_used_blocks"] == whole["num_used_blocks"]  # counts: the same
    assert "no running requests" in their_views
    (ours_alone,) = our_snap["requests"]
    assert ours_alone["request_id"] == rid
    assert tokenizer.decode(ours_alone["tail_token_ids"]).startswith(SECRET_A)
    assert set(our_snap["blocks"]) == {str(b) for b in ours_alone["block_table"]}
    assert our_views.count(rid) >= 3 and SECRET_A in our_views  # blocks, speculation, adapters
    assert "finished" in job.result()[1]
    idle = wait_idle(state.engine)
    assert idle["num_cached_free_blocks"] > 0  # A's prompt block, cached: listed for nobody
    assert snapshot(url, API_KEY)["blocks"] == snapshot(url, OTHER_KEY)["blocks"] == {}
    # B's request through the API, streamed.
    body = {"model": "tiny", "prompt": SECRET_B, "max_tokens": 16, "ignore_eos": True}
    body["stream"] = True

    def stream() -> str:
        with httpx.stream(
            "POST", url + "/v1/completions", json=body, headers=bearer(OTHER_KEY), timeout=120
        ) as r:
            return r.read().decode()

    with ThreadPoolExecutor(1) as pool, paused(state) as pause:
        answer = pool.submit(stream)
        assert pause.reached.wait(60)
        our_views, their_views = views(ours), views(theirs)
        our_snap, their_snap = snapshot(url, API_KEY), snapshot(url, OTHER_KEY)
    (theirs_alone,) = their_snap["requests"]
    assert theirs_alone["request_id"].startswith("cmpl-")
    assert SECRET_B in their_views and theirs_alone["request_id"] in their_views
    for leaked in (theirs_alone["request_id"], SECRET_B):
        assert leaked not in our_views and leaked not in json.dumps(our_snap)
    assert our_snap["requests"] == [] and our_snap["blocks"] == {}
    assert answer.result().endswith("[DONE]\n\n")
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_the_page_shows_the_refusal(shared):
    """In the browser (signed in with the /login cookie) a refused generate shows the API's
    message on the page, the limit named."""
    from playwright.sync_api import sync_playwright
    from test_playground import _chromium

    url, state = shared
    ours = client(url, API_KEY)
    form_type = {"Content-Type": "application/x-www-form-urlencoded"}
    login = httpx.post(url + "/login", content=f"key={OTHER_KEY}", headers=form_type)
    name, _, token = login.headers["set-cookie"].split(";")[0].partition("=")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=_chromium(), args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1500})
            context.add_cookies([{"name": name, "value": token, "url": url}])
            page = context.new_page()
            page.goto(url + "/", wait_until="load")
            page.wait_for_selector("#generate", timeout=60_000)
            with paused(state):  # (the views still refresh: the engine's lock is free)
                jobs = [ours.submit(*form("abc"), api_name="/generate") for _ in range(2)]
                until(lambda: state.admission.num_requests == 2, "two requests held")
                page.fill("#prompt textarea", "abc")
                page.click("#generate")
                page.get_by_text(FULL).wait_for(timeout=60_000)
        finally:
            browser.close()
    assert all("finished" in job.result()[1] for job in jobs)
    assert_all_returned(state)
