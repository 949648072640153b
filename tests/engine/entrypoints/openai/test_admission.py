"""Admission control (issue 41, finding 2): prompts per request, requests held and their
prompt tokens are bounded; past the bounds a 429 with Retry-After in OpenAI's shape (a 400
naming prompt for a request that could never fit), /health still answers, and every block
comes back after the burst. Before, any number of prompts was taken and nothing was ever
refused.

To hold requests in the server without timing, the tests hold the engine's lock (the one
each step takes): admitted requests then wait in the server, as in a real backlog."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from web import assert_all_returned, engine_held, tiny_serving, until

from engine.entrypoints.openai.admission import AdmissionLimits

LIMITS = AdmissionLimits(max_prompts_per_request=4, max_queued_requests=6, max_queued_tokens=100)


@pytest.fixture(scope="module")
def limited(tiny_llama):
    with tiny_serving(tiny_llama, limits=LIMITS) as served:
        yield served


def post(url: str, body: dict, **kwargs) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 2, **body}
    return httpx.post(url + "/v1/completions", json=body, timeout=120, **kwargs)


def test_prompts_per_request_at_and_past_the_limit(limited):
    url, state = limited
    r = post(url, {"prompt": [[5, 6]] * 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    r = post(url, {"prompt": ["a"] * 5})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"] == (
        "prompt holds 5 prompts; at most 4 per request (--max-prompts-per-request)"
    )
    generated = state.engine.snapshot()["num_generated_tokens"]
    flood = post(url, {"prompt": [[1]] * 1_000_000})  # the finding's body: ~4 MB of prompts
    assert flood.status_code == 400 and "holds 1000000 prompts" in flood.text
    assert state.engine.snapshot()["num_generated_tokens"] == generated
    assert_all_returned(state)


def test_queued_requests_past_the_limit_get_429(limited):
    """3 prompts x n=2 fill the 6 places (a stream holds them until it ends); one more is a
    429 with Retry-After, through the official client a RateLimitError; /health answers."""
    url, state = limited
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with ThreadPoolExecutor(1) as pool:
        with engine_held(state):
            body = {"prompt": [[5, 6], [7], [8, 9]], "n": 2, "stream": True}
            held = pool.submit(lambda: post(url, body).text)
            until(lambda: state.admission.num_requests == 6, "the stream is admitted")
            r = post(url, {"prompt": "one more"})
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"] == {
                "message": "the server holds 6 requests and takes at most 6 "
                "(--max-queued-requests); this one adds 1: retry after 1 s",
                "type": "requests",
                "param": None,
                "code": "rate_limit_exceeded",
            }
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model="tiny", prompt="x", max_tokens=1)
            assert httpx.get(url + "/health", timeout=5).json() == {"status": "ok"}
            assert state.admission.num_refused == 2
        events = held.result()
    assert events.count('"finish_reason": "length"') == 6 and events.endswith("[DONE]\n\n")
    assert post(url, {"prompt": "one more"}).status_code == 200
    assert_all_returned(state)


def test_queued_tokens_at_and_past_the_limit(limited):
    url, state = limited
    with ThreadPoolExecutor(2) as pool:
        with engine_held(state):
            first = pool.submit(post, url, {"prompt": list(range(10, 70))})  # 60 tokens
            until(lambda: state.admission.num_tokens == 60, "60 tokens admitted")
            r = post(url, {"prompt": list(range(10, 51))})  # 41: one past the 100
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert "holds 60 prompt tokens and takes at most 100 (--max-queued-tokens)" in r.text
            second = pool.submit(post, url, {"prompt": list(range(10, 50))})  # 40: exactly
            until(lambda: state.admission.num_tokens == 100, "100 tokens admitted")
        assert first.result().status_code == second.result().status_code == 200
    assert_all_returned(state)


@pytest.mark.parametrize("prompt, n", [(list(range(101)), 1), (list(range(51)), 2)])
def test_a_request_that_can_never_fit_is_a_400(limited, prompt, n):
    url, state = limited
    r = post(url, {"prompt": prompt, "n": n})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert f"hold {len(prompt) * n} tokens" in r.text and "--max-queued-tokens" in r.text
    assert_all_returned(state)


def test_beam_search_is_counted_by_its_width(limited):
    """Beam search holds its beam width (4 held + 3 beams: past the 6 places, a 429)."""
    url, state = limited
    with ThreadPoolExecutor(1) as pool:
        with engine_held(state):
            held = pool.submit(post, url, {"prompt": [[5, 6]] * 4})
            until(lambda: state.admission.num_requests == 4, "4 admitted")
            beams = {"prompt": [5, 6], "use_beam_search": True, "n": 3, "temperature": 0}
            assert post(url, beams).status_code == 429
        assert held.result().status_code == 200
    assert post(url, {"prompt": [5, 6], "use_beam_search": True, "n": 3}).status_code == 200
    assert_all_returned(state)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_queued_tokens must be an integer >= 1, got 0"):
        AdmissionLimits(max_queued_tokens=0)
