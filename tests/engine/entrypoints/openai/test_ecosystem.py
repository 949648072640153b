"""Fields clients written for vLLM and llama.cpp send, the rule for the rest
(engine/entrypoints/openai/ecosystem.py), and GET /tokenizer_info for lm-evaluation-harness's
remote tokenizer: the openai SDK, LangChain's ChatOpenAI and lm-eval's own client against real
servers (the shared SmolLM2 one, and a tiny Qwen3 whose chat template reads enable_thinking
as Qwen3's does)."""

from __future__ import annotations

import logging
import math

import httpx
import langchain_openai
import openai
import pytest
from transformers import AutoTokenizer
from web import API_KEY, tiny_serving, wait_idle

from engine import SamplingParams
from engine.models.registry import resolve_model
from models import make_tiny_model

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Name three colours."}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Qwen3's way: with enable_thinking false the generation prompt holds an empty thinking block.
# raise_exception is how templates refuse input (a request's variables can trigger it).
THINKING_TEMPLATE = (
    "{% if fail is defined %}{{ raise_exception('the template refuses fail') }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
NO_THINKING = {"enable_thinking": False}
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A tiny random Qwen3 with the thinking template, behind the API key; its tokenizer."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-thinking"), "qwen3")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(str(path))
    with tiny_serving(path, api_keys=(API_KEY,)) as (url, state):
        yield url, state, AutoTokenizer.from_pretrained(str(path))


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)


def rendered_ids(tokenizer, messages, **kwargs) -> list[int]:
    """HF's rendering: the oracle for what the server's template saw."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def tokenize(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/tokenize", json=body, headers=AUTH)


def test_chat_template_kwargs_reach_the_template(thinking):
    """chat_template_kwargs change the prompt exactly as HF's apply_chat_template does with
    them: in /tokenize and in the chat endpoint, whose reply is the completion of those ids."""
    url, state, tokenizer = thinking
    plain = rendered_ids(tokenizer, CHAT, add_generation_prompt=True)
    without = rendered_ids(tokenizer, CHAT, add_generation_prompt=True, **NO_THINKING)
    assert tokenizer.decode(without[len(plain) :]) == "<think>\n\n</think>\n\n"
    assert without[: len(plain)] == plain
    assert tokenize(url, {"messages": CHAT}).json()["tokens"] == plain
    body = {"messages": CHAT, "chat_template_kwargs": NO_THINKING}
    assert tokenize(url, body).json()["tokens"] == without
    client = sdk(url)
    args = dict(model="tiny", messages=CHAT, max_tokens=6, temperature=0)
    chat = client.chat.completions.create(**args, extra_body={"chat_template_kwargs": NO_THINKING})
    assert chat.usage.prompt_tokens == len(without)
    same = client.completions.create(model="tiny", prompt=without, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == same.choices[0].text
    assert client.chat.completions.create(**args).usage.prompt_tokens == len(plain)
    wait_idle(state.engine)


def test_continue_final_message_and_generation_prompt_on_chat(thinking):
    """vLLM's add_generation_prompt / continue_final_message on the chat endpoint: the prompt
    /tokenize renders (HF's), and both at once is a 400 naming continue_final_message."""
    url, _, tokenizer = thinking
    partial = [*CHAT, {"role": "assistant", "content": "Red, green and"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    want = rendered_ids(tokenizer, partial, **options)
    assert tokenizer.decode(want).endswith("Red, green and")
    assert tokenize(url, {"messages": partial, **options}).json()["tokens"] == want
    client = sdk(url)
    args = dict(model="tiny", messages=partial, max_tokens=4, temperature=0)
    chat = client.chat.completions.create(**args, extra_body=options)
    assert chat.usage.prompt_tokens == len(want)
    same = client.completions.create(model="tiny", prompt=want, max_tokens=4, temperature=0)
    assert chat.choices[0].message.content == same.choices[0].text
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**args, extra_body={"continue_final_message": True})
    assert caught.value.body["param"] == "continue_final_message"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"tokenize": True}, ["'tokenize'"]),
        ({"add_generation_prompt": False}, ["'add_generation_prompt'"]),
        ({"fail": True}, ["the template refuses fail"]),  # the template's own refusal
    ],
)
def test_chat_template_kwargs_the_template_cannot_take_are_a_400(thinking, kwargs, words):
    url, state, _ = thinking
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 2, "chat_template_kwargs": kwargs}
    for path in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(url + path, json=body, headers=AUTH)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "chat_template_kwargs"
        assert all(w in error["message"] for w in words), error
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_unknown_fields_are_ignored_named_in_a_header_and_logged(client, caplog):
    """vLLM's rule: a field nobody defines changes nothing, whole or streamed, and comes back
    named in X-Tandem-Ignored-Fields (and in the server log); known fields are not named."""
    args = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    plain = client.chat.completions.with_raw_response.create(**args, extra_body={"top_k": 5})
    assert "x-tandem-ignored-fields" not in plain.headers
    extra = {"top_k": 5, "frobnicate": 1, "vllm_xargs": {"a": 1}}
    with caplog.at_level(logging.WARNING, logger="tandem.server"):
        raw = client.chat.completions.with_raw_response.create(**args, extra_body=extra)
    assert raw.headers["x-tandem-ignored-fields"] == "frobnicate, vllm_xargs"
    assert "/v1/chat/completions: fields ignored" in caplog.text and "frobnicate" in caplog.text
    content = plain.parse().choices[0].message.content
    assert raw.parse().choices[0].message.content == content
    with client.chat.completions.with_streaming_response.create(
        **args, stream=True, extra_body=extra
    ) as stream:
        assert stream.headers["x-tandem-ignored-fields"] == "frobnicate, vllm_xargs"
        text = "".join(c.choices[0].delta.content or "" for c in stream.parse() if c.choices)
    assert text == content
    completion = client.completions.with_raw_response.create(
        model=MODEL, prompt="One, two,", max_tokens=3, extra_body={"best_guess": True}
    )
    assert completion.headers["x-tandem-ignored-fields"] == "best_guess"


def test_ignored_field_names_cannot_forge_headers(smol):
    """Field names are the client's text: only plain names are shown, at most 16, the rest
    counted; a name with a line break never becomes a header of its own."""
    url, _ = smol
    body = {"prompt": "hi", "max_tokens": 1, "a\r\nX-Forged: 1": 1, "é": 2, "n" * 65: 3}
    body |= {f"field_{i:02d}": i for i in range(20)}
    r = httpx.post(url + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    assert "x-forged" not in r.headers
    shown = [f"field_{i:02d}" for i in range(16)]
    assert r.headers["x-tandem-ignored-fields"] == ", ".join([*shown, "+7 more"])
    r = httpx.post(url + "/tokenize", json={"prompt": "hi", "return_tokens": True}, headers=AUTH)
    assert r.headers["x-tandem-ignored-fields"] == "return_tokens"  # (refused on generation)


NOT_SERVED = [
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"web_search_options": {}}, "web_search_options"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("chat", {"echo": True}, "echo"),
    ("chat", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("chat", {"n_probs": 21}, "n_probs"),
    ("chat", {"n_probs": 2, "logprobs": False}, "n_probs"),
    ("chat", {"n_predict": 0}, "n_predict"),
    ("chat", {"n_predict": 3, "max_completion_tokens": 4}, "n_predict"),
    ("chat", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("completions", {"samplers": ["top_k", "temperature"]}, "samplers"),
    ("completions", {"t_max_predict_ms": 100}, "t_max_predict_ms"),
    ("completions", {"return_tokens": True}, "return_tokens"),
    ("completions", {"typical_p": 0.5}, "typical_p"),
    ("completions", {"logits_processors": ["my.Processor"]}, "logits_processors"),
    ("completions", {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ("completions", {"n_probs": 2, "logprobs": 3}, "n_probs"),
    ("completions", {"cache_prompt": "yes"}, "cache_prompt"),  # types are still checked
]


@pytest.mark.parametrize(("endpoint", "fields", "param"), NOT_SERVED)
def test_fields_known_but_not_served_are_a_400_naming_them(smol, endpoint, fields, param):
    url, state = smol
    body = {"model": MODEL, "max_tokens": 2} | fields
    body |= {"prompt": "hi"} if endpoint == "completions" else {"messages": CHAT}
    if "max_completion_tokens" in fields:
        del body["max_tokens"]
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    r = httpx.post(url + path, json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_values_that_change_nothing_are_accepted(client):
    """Known fields at values that change nothing (and the no-op fields other servers'
    clients send) answer as without them, and are not named as ignored."""
    args = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**args).choices[0].message.content
    extra = {
        "modalities": ["text"],
        "echo": False,
        "typical_p": 1.0,
        "return_tokens": False,
        "t_max_predict_ms": 0,
        "cache_prompt": True,
        "id_slot": 0,
        "timings_per_token": True,
        "priority": 3,
        "request_id": "client-7",
        "spaces_between_special_tokens": True,
        "guided_decoding_backend": "xgrammar",
        "user": "u-1",
        "metadata": {"run": "7"},
        "store": False,
    }
    raw = client.chat.completions.with_raw_response.create(**args, extra_body=extra)
    assert "x-tandem-ignored-fields" not in raw.headers
    assert raw.parse().choices[0].message.content == plain
    assert raw.parse().id != "client-7"  # ids stay the server's


def test_llama_cpp_names_are_openai_fields(client):
    """n_predict is max_tokens; n_probs is logprobs (chat: logprobs + top_logprobs): the same
    answers, token for token and logprob for logprob."""
    args = dict(model=MODEL, prompt="One, two, three,", temperature=0)
    want = client.completions.create(**args, max_tokens=5, logprobs=3, extra_body=IGNORE_EOS)
    got = client.completions.create(**args, extra_body={"n_predict": 5, "n_probs": 3} | IGNORE_EOS)
    assert got.usage.completion_tokens == 5
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].logprobs.top_logprobs == want.choices[0].logprobs.top_logprobs
    chat = dict(model=MODEL, messages=CHAT, temperature=0)
    want = client.chat.completions.create(**chat, max_tokens=4, logprobs=True, top_logprobs=2)
    got = client.chat.completions.create(**chat, extra_body={"n_predict": 4, "n_probs": 2})
    assert got.choices[0].logprobs == want.choices[0].logprobs
    assert got.choices[0].message.content == want.choices[0].message.content


def test_n_predict_minus_one_runs_to_the_context(thinking):
    """llama.cpp's n_predict -1 is no limit, on completions too (whose default is 16)."""
    url, state, _ = thinking
    prompt = list(range(40, 60))
    r = sdk(url).completions.create(
        model="tiny", prompt=prompt, temperature=0, extra_body={"n_predict": -1} | IGNORE_EOS
    )
    assert r.usage.completion_tokens == state.max_model_len - len(prompt)


def test_truncate_prompt_tokens_keeps_the_last_tokens(thinking):
    """vLLM's truncate_prompt_tokens: the model reads the prompt's last N tokens (echo shows
    them), on completions and chat alike."""
    url, _, tokenizer = thinking
    client = sdk(url)
    ids = tokenizer.encode("The quick brown fox jumps")
    args = dict(model="tiny", max_tokens=4, temperature=0)
    cut = client.completions.create(
        **args, prompt=ids, echo=True, extra_body={"truncate_prompt_tokens": 6}
    )
    tail = client.completions.create(**args, prompt=ids[-6:])
    assert cut.usage.prompt_tokens == 6
    assert cut.choices[0].text == tokenizer.decode(ids[-6:]) + tail.choices[0].text
    chat_ids = rendered_ids(tokenizer, CHAT, add_generation_prompt=True)
    chat = client.chat.completions.create(
        **args, messages=CHAT, extra_body={"truncate_prompt_tokens": 5}
    )
    assert chat.usage.prompt_tokens == 5
    same = client.completions.create(**args, prompt=chat_ids[-5:])
    assert chat.choices[0].message.content == same.choices[0].text


def test_langchain_chat_openai_defaults_and_extra_body(thinking):
    """LangChain's ChatOpenAI sends only fields the server knows (no ignored-fields header),
    and its extra_body's chat_template_kwargs reach the template."""
    url, _, tokenizer = thinking
    seen: list[httpx.Response] = []
    hooks = {"response": [seen.append]}
    llm = langchain_openai.ChatOpenAI(
        model="tiny",
        base_url=url + "/v1",
        api_key=API_KEY,
        temperature=0,
        max_tokens=4,
        max_retries=0,
        http_client=httpx.Client(event_hooks=hooks),
        extra_body={"chat_template_kwargs": NO_THINKING, "top_k": 20, "cache_prompt": True},
    )
    reply = llm.invoke("Name three colours.")
    want = rendered_ids(tokenizer, CHAT, add_generation_prompt=True, **NO_THINKING)
    assert reply.response_metadata["token_usage"]["prompt_tokens"] == len(want)
    assert seen and all("x-tandem-ignored-fields" not in r.headers for r in seen)
    same = sdk(url).completions.create(model="tiny", prompt=want, max_tokens=4, temperature=0)
    assert reply.content == same.choices[0].text


def test_tokenizer_info_answers_as_vllm_behind_the_key(smol, offline):
    """GET /tokenizer_info: vLLM's shape (the tokenizer's class, special tokens as text, the
    chat template), the API key required, no path on this machine in it."""
    url, state = smol
    assert httpx.get(url + "/tokenizer_info").status_code == 401
    r = httpx.get(url + "/tokenizer_info", headers=AUTH)
    assert r.status_code == 200
    info, tokenizer = r.json(), offline.tokenizer
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert (info["eos_token"], info["bos_token"]) == ("<|im_end|>", "<|im_start|>")
    assert (info["pad_token"], info["unk_token"]) == (tokenizer.pad_token, tokenizer.unk_token)
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == state.max_model_len == 2048
    assert info["added_tokens_decoder"]["0"] == "<|endoftext|>"
    for place in (str(resolve_model(MODEL)), "/root", "/home", "/tmp", ".cache"):
        assert place not in r.text


def test_lm_eval_remote_tokenizer_against_the_server(smol, offline, monkeypatch):
    """lm-evaluation-harness's tokenizer_backend=remote, its own client: the tokenizer it reads
    from /tokenizer_info and /tokenize is the model's, its chat template renders as HF's, and a
    loglikelihood it scores through /v1/completions equals the offline prompt logprobs."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    url, _ = smol
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    lm = LocalCompletionsAPI(
        model=MODEL,
        base_url=f"{url}/v1/completions",
        tokenizer_backend="remote",
        auth_token=API_KEY,
        max_retries=1,
    )
    tokenizer = offline.tokenizer
    text = "Paged attention keeps KV blocks in a pool."
    assert lm.tok_encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert lm.eot_token_id == tokenizer.eos_token_id
    assert lm.decode_batch([tokenizer.encode(text)]) == [text]
    want_chat = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert lm.tokenizer.apply_chat_template(CHAT) == want_chat
    context, continuation = "The capital of France is", " Paris"
    request = Instance("loglikelihood", {}, (context, continuation), 0)
    ((score, _),) = lm.loglikelihood([request], disable_tqdm=True)
    ids = tokenizer.encode(context) + tokenizer.encode(continuation)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    (out,) = offline.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    n = len(tokenizer.encode(context))
    want = sum(out.prompt_logprobs[p][ids[p]].logprob for p in range(n, len(ids)))
    assert math.isclose(score, want, rel_tol=1e-4, abs_tol=1e-4)
