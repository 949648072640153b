"""The OpenAI-compatible server, driven with the official `openai` client over real HTTP."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tools_cases import ADD_TOOL
from web import API_KEY, wait_idle

from engine import SamplingParams

MODEL = "smollm2-135m-instruct"


CHAT = [{"role": "user", "content": "Name three colours."}]


def test_models_lists_base_and_adapters(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL, "demo-lora-a", "demo-lora-b"]


def test_completion_equals_offline(client, offline):
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0
    )
    ref = offline.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12))
    assert r.choices[0].text == ref[0].outputs[0].text
    assert r.usage.completion_tokens == len(ref[0].outputs[0].token_ids)
    assert r.usage.prompt_tokens == len(ref[0].prompt_token_ids)
    assert r.choices[0].finish_reason == "length"


def test_chat_equals_offline_and_stream_equals_whole(client, offline):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    ref = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert whole.choices[0].message.content == ref[0].outputs[0].text
    assert whole.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # usage in the last chunk
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # The whole answer computed this prompt a moment ago: the stream finds its blocks cached.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16


def test_completion_stream_n2_prompts2(client):
    """Two prompts x n=2 streamed: four choices, each equal to the non-streamed one."""
    args = dict(
        model=MODEL, prompt=["One, two,", "Red, green,"], max_tokens=8, n=2, seed=7, temperature=0.8
    )
    whole = client.completions.create(**args)
    texts: dict[int, str] = {}
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1, 2, 3]
    assert texts == {c.index: c.text for c in whole.choices}


def test_stream_sends_each_finish_once(client):
    """n = 2 where one completion stops early (a stop string only it produces): its finish
    chunk comes once, while its sibling goes on streaming."""
    args = dict(model=MODEL, prompt="One, two,", max_tokens=12, n=2, seed=7, temperature=0.8)
    first, second = (c.text for c in client.completions.create(**args).choices)
    stop = next(
        first[i : i + 2] for i in range(1, len(first) - 1) if first[i : i + 2] not in second
    )
    finishes: dict[int, list[str]] = {0: [], 1: []}
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(**args, stop=[stop], stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finishes[c.index].append(c.finish_reason)
    assert finishes == {0: ["stop"], 1: ["length"]}
    assert texts == {0: first[: first.index(stop)], 1: second}


def test_logprobs_shapes(client):
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) == 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(
        max(t.values()) == pytest.approx(v)
        for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    c = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == c.choices[0].message.content


def test_prompt_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt="The cat sat", max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    positions = r.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == r.usage.prompt_tokens and positions[0] is None
    assert all(
        1 <= len(p) <= 2 and all(v["logprob"] <= 0 for v in p.values()) for p in positions[1:]
    )


def test_seeded_sampling_and_logprobs_equal_offline(client, offline):
    """A seeded sampled completion over HTTP (the server speculates, n-gram) equals the offline
    API's without speculation: text, each token's logprob and its top 2, and the prompt's
    logprobs, by value."""
    prompt = "The cat sat on the mat. The cat sat"
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=10,
        temperature=0.8,
        seed=11,
        logprobs=2,
        extra_body={"prompt_logprobs": 1},
    )
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=10, logprobs=2, prompt_logprobs=1)
    (ref,) = offline.generate(prompt, params, use_tqdm=False)
    want = ref.outputs[0]
    got = r.choices[0]
    assert got.text == want.text and len(want.token_ids) == 10
    values = [lp[t].logprob for lp, t in zip(want.logprobs, want.token_ids, strict=True)]
    assert got.logprobs.token_logprobs == pytest.approx(values, rel=1e-4, abs=1e-5)
    for top, position in zip(got.logprobs.top_logprobs, want.logprobs, strict=True):
        expected = {lp.decoded_token: lp.logprob for lp in position.values() if lp.rank <= 2}
        assert top == pytest.approx(expected, rel=1e-4, abs=1e-5)
    positions = got.model_extra["prompt_logprobs"]
    assert positions[0] is None and ref.prompt_logprobs[0] is None
    for served, offline_position in zip(positions[1:], ref.prompt_logprobs[1:], strict=True):
        assert {int(t): v["logprob"] for t, v in served.items()} == pytest.approx(
            {t: lp.logprob for t, lp in offline_position.items()}, rel=1e-4, abs=1e-5
        )


def test_adapter_selected_by_model_name(client, offline, demo_adapters):
    prompt = "Once upon a time"
    params = SamplingParams(temperature=0, max_tokens=16)
    outs = {}
    for name in [MODEL, *demo_adapters]:
        r = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0)
        outs[name] = r.choices[0].text
        lora = demo_adapters.get(name)
        ref = offline.generate(prompt, params, use_tqdm=False, lora_request=lora)
        assert outs[name] == ref[0].outputs[0].text, name
    assert len(set(outs.values())) == 3  # each adapter changes the output


def test_structured_outputs(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "year": {"type": "integer"}},
        "required": ["city", "year"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Where and when were the first modern Olympics?"}],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(
        model=MODEL,
        prompt="A date:",
        max_tokens=20,
        temperature=0.9,
        seed=3,
        extra_body={"structured_outputs": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}},
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is water wet?"}],
        max_tokens=8,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert r.choices[0].message.content in ("yes", "no")


LONG = "word " * 3000  # > 2048 tokens
BAD_SCHEMA_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}
BEAMS = {"use_beam_search": True}
NAMED_MUL = {"type": "function", "function": {"name": "mul"}}
BAD_CALL_MESSAGE = {
    "role": "assistant",
    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}],
}
# (endpoint, body fields, status, param named, words the message must contain)
ERRORS = [
    ("completions", {"temperature": -1}, 400, "temperature", ["temperature", "-1"]),
    ("completions", {"top_p": 1.5}, 400, "top_p", ["top_p"]),
    ("completions", {"n": 0}, 400, "n", ["n must"]),
    ("completions", {"max_tokens": 0}, 400, "max_tokens", ["max_tokens"]),
    ("completions", {"max_tokens": "ten"}, 400, "max_tokens", ["integer"]),
    ("completions", {"logprobs": 30}, 400, "logprobs", ["logprobs"]),
    ("completions", {"top_k": -5}, 400, "top_k", ["top_k"]),
    ("completions", {"stop": 5}, 400, "stop", ["stop"]),
    ("completions", {"logit_bias": {"x": 1}}, 400, "logit_bias", ["logit_bias"]),
    ("completions", {"logit_bias": {"999999": 1}}, 400, "logit_bias", ["999999"]),
    ("completions", {"num_speculative_tokens": 99}, 400, "num_speculative_tokens", ["99"]),
    ("completions", {"prompt": LONG}, 400, "prompt", ["tokens", "2048"]),
    ("completions", {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens", ["5000", "2048"]),
    ("completions", {"prompt": []}, 400, "prompt", ["prompt"]),
    ("completions", {"model": "nope"}, 404, "model", ["nope"]),
    ("completions", {"max_tokens": 0, "echo": False}, 400, "max_tokens", ["0 only with echo"]),
    ("completions", {"echo": "yes"}, 400, "echo", ["boolean"]),
    ("completions", {"response_format": {"type": "xml"}}, 400, "response_format", ["xml"]),
    (
        "completions",
        {"structured_outputs": {"regex": "(unclosed"}},
        400,
        "structured_outputs",
        ["regex"],
    ),
    (
        "completions",
        {"guided_choice": ["a"], "response_format": {"type": "json_object"}},
        400,
        "guided_choice",
        ["one constraint"],
    ),
    ("chat", {"messages": []}, 400, "messages", ["messages"]),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", ["role"]),
    ("chat", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages", ["2048"]),
    ("chat", {"tools": [{"type": "function"}]}, 400, "tools", ["tools[0]", "function"]),
    ("chat", {"tools": [BAD_SCHEMA_TOOL]}, 400, "tools", ["parameters", "'not'"]),
    ("chat", {"tools": [ADD_TOOL, ADD_TOOL]}, 400, "tools", ["same name"]),
    ("chat", {"tools": [ADD_TOOL], "tool_choice": "any"}, 400, "tool_choice", ["any"]),
    ("chat", {"tools": [ADD_TOOL], "tool_choice": NAMED_MUL}, 400, "tool_choice", ["mul"]),
    ("chat", {"tool_choice": "required"}, 400, "tool_choice", ["needs tools"]),
    (
        "chat",
        {
            "tools": [ADD_TOOL],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        400,
        "tool_choice",
        ["cannot be combined"],
    ),
    ("chat", {"tools": [ADD_TOOL], "parallel_tool_calls": 1}, 400, "parallel_tool_calls", ["bool"]),
    ("chat", {"messages": [BAD_CALL_MESSAGE]}, 400, "messages", ["arguments is not JSON"]),
    ("chat", {"top_logprobs": 2}, 400, "top_logprobs", ["logprobs"]),
    ("completions", BEAMS | {"stream": True}, 400, "stream", ["use_beam_search"]),
    ("completions", BEAMS | {"logprobs": 2}, 400, "logprobs", ["use_beam_search"]),
    ("completions", BEAMS | {"temperature": 0.7}, 400, "temperature", ["temperature"]),
    ("completions", BEAMS | {"n": 3, "best_of": 2}, 400, "best_of", ["best_of=2"]),
    ("completions", BEAMS | {"n": 11}, 400, "n", ["beam_width=11", "at most 20"]),
    ("completions", BEAMS | {"length_penalty": "long"}, 400, "length_penalty", ["number"]),
    ("completions", BEAMS | {"model": "demo-lora-a"}, 400, "model", ["base model"]),
    ("chat", BEAMS | {"tools": [ADD_TOOL]}, 400, "tools", ["use_beam_search"]),
    ("chat", {"presence_penalty": 3}, 400, "presence_penalty", ["presence_penalty"]),
]


@pytest.mark.parametrize(("endpoint", "fields", "status", "param", "words"), ERRORS)
def test_error_table(smol, endpoint, fields, status, param, words):
    url, state = smol
    body = {"model": MODEL, "max_tokens": 4}
    body |= {"prompt": "hi"} if endpoint == "completions" else {"messages": CHAT}
    body |= fields
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    r = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    snap = wait_idle(state.engine)  # nothing held, and the engine keeps serving
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_openai_fields_that_do_not_apply_are_accepted_and_ignored(client):
    """metadata, store, service_tier, ... change nothing (a field nobody defines is ignored
    and named in a header: test_ecosystem.py); an ignored field of the wrong type is a 400."""
    args = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**args)
    extra = dict(metadata={"run": "7"}, store=False, service_tier="auto", reasoning_effort="low")
    extra |= dict(safety_identifier="u-1", prompt_cache_key="k")
    ignored = client.chat.completions.create(**args, **extra)
    assert ignored.choices[0].message.content == plain.choices[0].message.content
    args = dict(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0)
    completion = client.completions.create(**args, extra_body=extra)
    assert completion.choices[0].text == client.completions.create(**args).choices[0].text
    with pytest.raises(openai.BadRequestError, match="metadata must be an object"):
        client.completions.create(**args, extra_body={"metadata": "x"})


SPEC_COUNTS = ("num_steps", "num_drafts", "num_accepted", "drafted_at", "accepted_at")


def test_speculation_counters_on_request(client):
    """Off unless asked for; asked, the request's own counters (the server speculates with
    n-gram lookup): drafted and accepted by position, consistent with the tokens emitted, and
    the same in the last streamed chunk as in the whole response (fixed k, greedy)."""
    prompt = "one two three four, one two three four, one two three four, one two"
    args = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    extra = {"num_speculative_tokens": 3, "ignore_eos": True}
    plain = client.completions.create(**args, extra_body=extra)
    assert "speculation" not in plain.model_extra
    asked = extra | {"return_spec_stats": True}
    whole = client.completions.create(**args, extra_body=asked)
    spec = whole.model_extra["speculation"]
    assert whole.choices[0].text == plain.choices[0].text
    assert spec["num_drafts"] > 0 and 0 < spec["num_accepted"] <= spec["num_drafts"]
    assert sum(spec["drafted_at"]) == spec["num_drafts"]
    assert sum(spec["accepted_at"]) == spec["num_accepted"]
    # The prefill's token, then per decode step one token plus its accepted drafts.
    assert whole.usage.completion_tokens >= 1 + spec["num_steps"] + spec["num_accepted"]
    chunks = list(client.completions.create(**args, stream=True, extra_body=asked))
    tail = chunks[-1].model_extra["speculation"]
    assert {k: tail[k] for k in SPEC_COUNTS} == {k: spec[k] for k in SPEC_COUNTS}


def test_snapshot_over_http_is_the_engines(smol, client):
    """GET /v1/snapshot: the playground's view of the engine as JSON, behind the API key."""
    url, state = smol
    client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    served = httpx.get(url + "/v1/snapshot", headers=headers).json()
    mine = state.engine.snapshot()
    assert served["num_blocks"] == mine["num_blocks"] and served["block_size"] == 16
    assert served["num_generated_tokens"] == mine["num_generated_tokens"] > 0
    assert served["speculation"]["method"] == "ngram"
    assert set(served) == set(mine) and served["num_free_blocks"] == served["num_blocks"]
    assert httpx.get(url + "/v1/snapshot").status_code == 401


def test_errors_leave_engine_serving(client):
    r = client.completions.create(model=MODEL, prompt="2 + 2 =", max_tokens=3, temperature=0)
    assert r.choices[0].text


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=CHAT)


def test_api_key(smol):
    url, _ = smol
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    bad = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer no"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # outside /v1: no key


def test_body_size_limit(smol):
    url, state = smol
    headers = {"Authorization": f"Bearer {API_KEY}"}
    big = {"model": MODEL, "prompt": "x" * (state.max_body_bytes + 10)}
    r = httpx.post(url + "/v1/completions", json=big, headers=headers)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

    def chunks():  # no content-length: counted as it streams
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 65536):
            yield payload[i : i + 65536]

    r = httpx.post(url + "/v1/completions", content=chunks(), headers=headers)
    assert r.status_code == 413
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


MAX_TOKENS = 1500


def _long_body(stream: bool) -> dict:
    return {
        "model": MODEL,
        "prompt": "Tell me a very long story.",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
        "logprobs": 1,  # a streamed chunk lists its tokens: the client counts what it saw
    }


def _record_aborts(monkeypatch, engine) -> dict[str, list[tuple[object, int]]]:
    """A spy on the engine's abort (it runs on the engine loop): for every group aborted, its
    engine requests and how many tokens each had generated at that moment."""
    at_abort: dict[str, list[tuple[object, int]]] = {}
    real = engine.abort_request

    def abort_request(request_id):
        group = engine.groups.get(request_id)
        if group is not None:
            at_abort[request_id] = [(r, r.num_output_tokens) for r in group.requests]
        real(request_id)

    monkeypatch.setattr(engine, "abort_request", abort_request)
    return at_abort


def _check_stopped_at_abort(at_abort: dict, seen: int) -> int:
    """The one request aborted, by its own record: ended as aborted with the tokens it had when
    the abort came (none after it), at least those the client saw, far short of max_tokens."""
    from engine.request import RequestStatus

    ((request, num_at_abort),) = [entry for entries in at_abort.values() for entry in entries]
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert request.num_output_tokens == num_at_abort
    assert seen <= num_at_abort < MAX_TOKENS
    return num_at_abort


def test_disconnect_while_streaming_aborts_the_request(smol, monkeypatch):
    """The client reads 8 tokens and hangs up. The engine's own record of that request: it
    ended aborted, generated nothing after the abort, and the abort came within a few steps of
    the hang-up (a generous guard: 200 tokens is seconds of decoding; measured: 1 token past
    what the client saw).
    Fails if a disconnect does not abort (the request runs on: wait_idle times out, or its
    count reaches max_tokens) or if an aborted request keeps being stepped (count > at abort)."""
    url, state = smol
    at_abort = _record_aborts(monkeypatch, state.engine.engine)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    seen = 0
    with httpx.stream("POST", url + "/v1/completions", json=_long_body(True), headers=headers) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    seen += len(choice["logprobs"]["tokens"])
            if seen >= 8:
                break
        assert state.engine.engine.groups  # running
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]
    assert _check_stopped_at_abort(at_abort, seen) <= seen + 200


def test_disconnect_while_waiting_aborts_the_request(smol, monkeypatch):
    """A whole-response client that gives up after 1.5 s: its request is aborted by the
    server's disconnect poll, by the request's own record (as above)."""
    url, state = smol
    at_abort = _record_aborts(monkeypatch, state.engine.engine)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=_long_body(False), headers=headers, timeout=1.5)
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]
    assert _check_stopped_at_abort(at_abort, 1) > 0


def test_metrics(smol, client):
    url, state = smol
    # A prompt the model keeps repeating: n-gram drafts whatever ran before this test.
    client.completions.create(
        model=MODEL, prompt="1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1,", max_tokens=16, temperature=0
    )
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "tandem_num_requests_running",
        "tandem_num_requests_waiting",
        "tandem_kv_cache_usage_ratio",
        "tandem_prefix_cache_hit_rate",
        "tandem_num_preemptions",
        "tandem_spec_draft_tokens",
        "tandem_spec_accepted_tokens",
        "tandem_generation_tokens",
        "tandem_generation_tokens_per_second",
        "tandem_time_to_first_token_seconds",
        "tandem_inter_token_latency_seconds",
    ):
        assert name in families, name

    def value(family: str, sample: str, **labels) -> float:
        return sum(
            s.value
            for s in families[family].samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
        )

    snap = state.engine.snapshot()
    assert (
        value("tandem_generation_tokens", "tandem_generation_tokens_total")
        == snap["num_generated_tokens"]
    )
    drafted = value("tandem_spec_draft_tokens", "tandem_spec_draft_tokens_total", position="0")
    accepted = value("tandem_spec_accepted_tokens", "tandem_spec_accepted_tokens_total")
    assert drafted == snap["speculation"]["drafted_at"][0] > 0
    assert accepted == snap["speculation"]["num_accepted"]
    finished = value(
        "tandem_e2e_request_latency_seconds", "tandem_e2e_request_latency_seconds_count"
    )
    ttft = value("tandem_time_to_first_token_seconds", "tandem_time_to_first_token_seconds_count")
    assert ttft >= finished > 0


# ---- many clients at once ------------------------------------------------------------------
