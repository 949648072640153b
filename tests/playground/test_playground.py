"""The Gradio playground: a real headless Chromium (Debian's, driven by Playwright) and
gradio_client against the app mounted on the HTTP server."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
from pathlib import Path

import httpx
import pytest
from tools_cases import ADD_TOOL
from web import serving, wait_idle

from engine.config import EngineConfig
from engine.entrypoints.async_engine import AsyncEngine
from engine.entrypoints.openai.server import ServerState, build_app
from engine.llm_engine import LLMEngine
from playground.demo_adapters import write_demo_adapters
from playground.ui import mount_playground

MODEL = "smollm2-135m-instruct"
ARTIFACTS = Path(os.environ.get("TANDEM_TEST_ARTIFACTS", Path(__file__).parents[1] / "artifacts"))


@pytest.fixture(scope="module")
def playground():
    adapters = write_demo_adapters(MODEL)
    engine = LLMEngine(
        EngineConfig(
            model=MODEL,
            num_threads=1,
            num_kv_blocks=256,
            speculative_method="ngram",
            enable_lora=True,
            max_model_len=2048,
        )
    )
    state = ServerState(AsyncEngine(engine), MODEL, adapters)
    app = mount_playground(build_app(state), state)
    with serving(app) as url:
        yield url, state
    state.engine.shutdown()


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing (make test installs it with apt-get)")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    return path


@contextlib.contextmanager
def _page(url: str):
    """A headless Chromium page on the playground, loaded until its form is there."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=_chromium(), args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1500})
            page.goto(url + "/", wait_until="load")
            page.wait_for_selector("#generate", timeout=60_000)
            yield page
        finally:
            browser.close()


def test_page_streams_and_shows_block_tables(playground):
    url, state = playground
    with _page(url) as page:
        page.fill("#prompt textarea", "Write a short poem about paged attention.")
        page.click("#generate")
        # Streamed: five tokens are on the page while the request still runs (if they came
        # only at its end, this never holds)...
        page.wait_for_function(
            "document.querySelectorAll('#output .tk').length >= 5"
            " && !document.querySelector('#stats').innerText.includes('finished')",
            timeout=60_000,
            polling=50,
        )
        # ...and the live view draws its block table.
        page.wait_for_function(
            "document.querySelectorAll('#blocks-view .blk-row .blk').length > 0",
            timeout=30_000,
        )
        assert page.locator("#blocks-view .blk").count() >= 256
        page.wait_for_function(
            "document.querySelector('#stats').innerText.includes('finished')",
            timeout=120_000,
        )
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)
        text = page.locator("#output").inner_text()
        assert len(text.strip()) > 10
        # A constrained request from the form: the output is one of the choices.
        choices = ["paged", "contiguous", "sliding"]
        page.get_by_text("Constraint", exact=True).click()
        page.locator("#constraint-kind input").click()
        page.get_by_role("option", name="choice", exact=True).click()
        page.fill("#constraint-text textarea", "\n".join(choices))
        page.fill("#prompt textarea", "Which KV cache layout does vLLM use?")
        page.click("#generate")
        page.wait_for_function(
            "document.querySelector('#stats').innerText.includes('finished: stop')",
            timeout=120_000,
        )
        # The emitted tokens (struck-out rejected drafts aside), then the end-of-sequence
        # token the page shows as text.
        emitted = page.eval_on_selector_all(
            "#output .tk", "spans => spans.map(s => s.textContent).join('')"
        )
        assert emitted.removesuffix("<|im_end|>") in choices
        # The load test: requests sharing a system prompt share its blocks, and the grid
        # shows those blocks with their reference counts.
        page.click("#load-test")
        page.wait_for_function(
            "document.querySelectorAll('#blocks-view .blk-shared').length > 0",
            timeout=60_000,
        )
        shared = page.locator("#blocks-view .blk-grid .blk-shared").first.inner_text()
        assert int(shared) >= 2
        page.screenshot(path=str(ARTIFACTS / "playground-load-test.png"), full_page=True)
        page.wait_for_function(
            "document.querySelector('#load-status').innerText.includes('12/12 requests')",
            timeout=180_000,
        )
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]


def _run(page, button: str, stats: str, other: str | None = None) -> None:
    """Clicks `button` and waits until the stats line `stats` (and `other`) shows a finished
    request other than the one it showed before (each line starts with its request's id)."""
    selectors = [s for s in (stats, other) if s]
    before = [page.inner_text(s) for s in selectors]
    page.click(button)
    for s, old in zip(selectors, before, strict=True):
        old_id = re.search(r"(ui-\w+):", old)
        page.wait_for_function(
            f"(t => t.includes('finished') && /ui-\\w+:/.test(t)"
            f" && !t.includes({json.dumps(old_id[1] if old_id else '@')}))"
            f"(document.querySelector('{s}').innerText)",
            timeout=120_000,
        )


def _emitted(page, selector: str) -> str:
    """The tokens a pane shows (struck-out rejected drafts aside), the end-of-sequence token's
    text removed."""
    text = page.eval_on_selector_all(
        f"{selector} .tk", "spans => spans.map(s => s.textContent).join('')"
    )
    return text.replace("↵", "\n").removesuffix("<|im_end|>")


def _prompt_tokens(page) -> int:
    return int(re.search(r"prompt (\d+) tokens", page.inner_text("#stats"))[1])


def test_page_keeps_a_conversation_and_races_speculation(playground):
    """Chat turns build on each other (the second turn's prompt is the template over both
    turns, token for token), "New conversation" starts afresh, and the race streams the same
    request with and without speculation: greedy, the same text on both sides, drafts accepted
    only on the speculating side (here from the prediction box)."""
    url, state = playground
    from engine.entrypoints.llm import chat_prompt_ids

    tokenizer = state.tokenizer
    with _page(url) as page:
        first, second = "My name is Ada. Say hello to me.", "What is my name?"
        page.fill("#prompt textarea", first)
        _run(page, "#generate", "#stats")
        reply = _emitted(page, "#output")
        page.wait_for_function(
            "document.querySelector('#conversation').innerText.includes('My name is Ada')",
            timeout=30_000,
        )
        page.fill("#prompt textarea", second)
        _run(page, "#generate", "#stats")
        history = [
            {"role": "user", "content": first},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": second},
        ]
        assert _prompt_tokens(page) == len(chat_prompt_ids(tokenizer, history))
        page.click("#new-chat")
        page.wait_for_function(
            "!document.querySelector('#conversation').innerText.includes('My name is Ada')",
            timeout=30_000,
        )
        _run(page, "#generate", "#stats")
        alone = [{"role": "user", "content": second}]
        assert _prompt_tokens(page) == len(chat_prompt_ids(tokenizer, alone))
        # The race, in completion mode, with a prediction the answer repeats.
        page.get_by_label("completion").check()
        page.fill("#prompt textarea", "Count: one, two, three, four, five,")
        page.fill("#prediction textarea", " six, seven, eight, nine, ten, eleven, twelve")
        _run(page, "#race", "#race-spec-stats", "#race-plain-stats")
        spec, plain = _emitted(page, "#race-spec"), _emitted(page, "#race-plain")
        assert spec == plain and len(spec) > 10
        assert page.locator("#race-spec .tk-a").count() > 0
        assert page.locator("#race-plain .tk-a").count() == 0
        assert "tokens/s" in page.inner_text("#race-plain-stats")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "playground-race.png"), full_page=True)
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_gradio_client(playground):
    url, state = playground
    from gradio_client import Client

    client = Client(url + "/", verbose=False)
    html, stats, _ = client.predict(
        "completion",
        "One, two, three, four, one, two, three, four, one, two,",
        0.0,
        1.0,
        0,
        24,
        -1,
        "ngram",
        4,
        False,
        "demo-lora-a",
        "choice",
        "three\nfour",
        "",
        "none",
        "",
        [],
        api_name="/generate",
    )
    assert "finished: stop" in stats
    assert 'class="tk tk-' in html
    with pytest.raises(Exception, match="regex"):  # a bad constraint is shown, not swallowed
        client.predict(
            "completion",
            "x",
            0.0,
            1.0,
            0,
            8,
            -1,
            "off",
            4,
            True,
            "(base model)",
            "regex",
            "(unclosed",
            "",
            "none",
            "",
            [],
            api_name="/generate",
        )
    # Tools in chat mode: a required call, its opening forced (free drafts), parsed in the stats.
    tools = json.dumps([ADD_TOOL])
    args = ["chat", "Add 2 and 40.", 0.0, 1.0, 0, 64, -1, "off", 4, True, "(base model)"]
    html, stats, _ = client.predict(
        *args, "none", "", tools, "required", "", [], api_name="/generate"
    )
    assert re.search(r'tool calls: add\(\{"a": \d+, "b": \d+\}\)', stats), stats
    assert 'class="tk tk-f' in html
    with pytest.raises(Exception, match="tool_choice"):
        client.predict(*args, "none", "", tools, "mul", "", [], api_name="/generate")
    summary = client.predict(6, api_name="/load_test")
    assert summary.startswith("load test: 6/6 requests finished"), summary
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]
    assert snap["prefix_cache"]["hit_tokens"] > 0  # the shared system prompt
    assert snap["lora"]["slot_loads"] > 0


def test_views_show_requests_from_http_clients(playground):
    """A request that comes in through /v1 shows up in the playground's live views."""
    url, state = playground
    from gradio_client import Client

    client = Client(url + "/", verbose=False)
    started = threading.Event()

    def stream():
        body = {
            "model": MODEL,
            "prompt": "Count slowly:",
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert started.wait(60)
        blocks, sharing, spec, adapters = client.predict(api_name="/views")
        assert "cmpl-" in blocks and "blk-row" in blocks
        assert "cmpl-" in adapters and "(base model)" in adapters
        assert "acceptance" in spec and "hit rate" in sharing
    finally:
        thread.join(120)
    wait_idle(state.engine)
