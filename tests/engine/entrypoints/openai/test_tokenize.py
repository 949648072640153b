"""vLLM's /tokenize and /detokenize on the SmolLM2 server (tests/engine/entrypoints/conftest.py)."""

from __future__ import annotations

import httpx
import pytest
from web import API_KEY

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Name three colours."}]


def tokenize(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"})


def test_tokenize_and_detokenize_prompts(smol, offline):
    """vLLM's /tokenize and /detokenize: a prompt's ids equal the tokenizer's, token strings on
    request, and the ids decode back to the text exactly."""
    url, _ = smol
    text = "Paged attention keeps  KV blocks in a pool, 3x faster!"
    tokenizer = offline.tokenizer
    plain = tokenize(url, "/tokenize", {"model": MODEL, "prompt": text}).json()
    want = tokenizer.encode(text)
    assert plain == {"count": len(want), "max_model_len": 2048, "tokens": want, "token_strs": None}
    r = tokenize(url, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(want)
    back = tokenize(url, "/detokenize", {"model": MODEL, "tokens": want}).json()
    assert back == {"prompt": text}
    # The adapters' names are models too; the tokenizer is the base model's.
    assert tokenize(url, "/tokenize", {"model": "demo-lora-a", "prompt": text}).json() == plain


def test_tokenize_chat_messages(smol, offline):
    """Messages through the chat template: ready for the reply (the chat endpoint's prompt), or
    without the generation prompt, or with the last message left open to be continued."""
    url, _ = smol
    reply = tokenize(url, "/tokenize", {"messages": CHAT}).json()["tokens"]
    assert reply == offline.apply_chat_template(CHAT)
    # Detokenized exactly, the template's special tokens kept.
    text = tokenize(url, "/detokenize", {"tokens": reply}).json()["prompt"]
    assert text == offline.tokenizer.decode(reply, skip_special_tokens=False)
    assert text.startswith("<|im_start|>") and "Name three colours." in text
    bare = {"messages": CHAT, "add_generation_prompt": False}
    without = tokenize(url, "/tokenize", bare).json()["tokens"]
    assert len(without) < len(reply) and reply[: len(without)] == without
    partial = [*CHAT, {"role": "assistant", "content": "Red, green and"}]
    body = {"messages": partial, "add_generation_prompt": False, "continue_final_message": True}
    ids = tokenize(url, "/tokenize", body).json()["tokens"]
    assert offline.tokenizer.decode(ids).endswith("Red, green and")


TOKENIZE_ERRORS = [
    ("/tokenize", {}, 400, "prompt", "exactly one of prompt and messages"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt", "exactly one"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "must be a string"),
    ("/tokenize", {"messages": [{"role": "wizard"}]}, 400, "messages", "role"),
    (
        "/tokenize",
        {"messages": CHAT, "continue_final_message": True},
        400,
        "continue_final_message",
        "add_generation_prompt=false",
    ),
    ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model", "nope"),
    ("/tokenize", {"prompt": "a", "documents": {}}, 400, "documents", "must be an array"),
    ("/detokenize", {}, 400, "tokens", "required"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "must be an array"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens", "-1"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens", str(10**9)),
    ("/detokenize", {"tokens": [True]}, 400, "tokens", "True"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), TOKENIZE_ERRORS)
def test_tokenize_errors_name_the_parameter(smol, path, body, status, param, words):
    url, _ = smol
    r = tokenize(url, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_tokenize_needs_the_api_key(smol):
    url, _ = smol
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        r = httpx.post(url + path, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_explicit_nulls_mean_the_defaults(smol, offline):
    """JSON null for an optional field is the field left out (the fuzz found a 500 here:
    `add_special_tokens: null` reached the tokenizer as None)."""
    url, _ = smol
    text = "Paged attention"
    body = {"prompt": text, "add_special_tokens": None, "continue_final_message": None}
    r = tokenize(url, "/tokenize", body)
    assert r.status_code == 200 and r.json()["tokens"] == offline.tokenizer.encode(text)
    body = {"prompt": text, "n": None, "best_of": 1, "max_tokens": 2, "temperature": 0}
    r = tokenize(url, "/v1/completions", {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    body = {"prompt": text, "use_beam_search": True, "n": 2, "length_penalty": None}
    r = tokenize(url, "/v1/completions", {"model": MODEL, "max_tokens": 2, **body})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
