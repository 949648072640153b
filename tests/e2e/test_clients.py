"""Real clients against the server: lm-evaluation-harness scoring a loglikelihood task built
from local data, and LangChain's ChatOpenAI binding tools and asking for structured output."""

from __future__ import annotations

import json
import math

import langchain_openai
import lm_eval
import pytest
from lm_eval.tasks import TaskManager
from tools_cases import ADD_TOOL, WEATHER_TOOL
from web import API_KEY, make_state, serving, wait_idle

from engine import LLM, SamplingParams
from engine.entrypoints.openai.server import build_app
from engine.models.registry import resolve_model

MODEL = "smollm2-135m-instruct"
# A multiple-choice task: lm-eval scores each choice by the loglikelihood of " <choice>" after
# the question, from /v1/completions with echo, logprobs 1 and max_tokens 1 (no hub: the
# documents are a local JSON-lines file).
DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["three", "four", "five"], "answer": 1},
    {"question": "The colour of the sky is", "choices": ["green", "red", "blue"], "answer": 2},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin"], "answer": 0},
]
TASK = """task: tandem_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def server():
    state = make_state(MODEL, quantization=None, num_kv_blocks=512, speculative_method="ngram")
    with serving(build_app(state)) as url:
        yield url, state
    state.engine.shutdown()


def test_lm_eval_loglikelihoods_equal_offline_prompt_logprobs(server, tmp_path, monkeypatch):
    url, state = server
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(path=data))
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": MODEL,
            "base_url": f"{url}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(resolve_model(MODEL)),
            "num_concurrent": 2,
            "max_retries": 1,
        },
        tasks=["tandem_local_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    samples = results["samples"]["tandem_local_mc"]
    assert len(samples) == len(DOCS)
    offline = LLM(MODEL, quantization=None, num_kv_blocks=256)
    tokenizer = offline.tokenizer
    for sample in samples:
        doc = sample["doc"]
        for (context, continuation), ((score, greedy),) in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            context_ids = tokenizer.encode(context)
            continuation_ids = tokenizer.encode(continuation)
            ids = context_ids + continuation_ids
            params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
            (out,) = offline.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
            positions = range(len(context_ids), len(ids))
            want = sum(out.prompt_logprobs[p][ids[p]].logprob for p in positions)
            # The same engine over HTTP; batches differ, so fp32 sums may differ in the last bits.
            assert math.isclose(score, want, rel_tol=1e-4, abs_tol=1e-4), (doc, continuation)
            assert greedy == all(out.prompt_logprobs[p][ids[p]].rank == 1 for p in positions)
    acc = results["results"]["tandem_local_mc"]["acc,none"]
    want_acc = sum(
        max(range(len(s["resps"])), key=lambda i: s["resps"][i][0][0]) == s["doc"]["answer"]
        for s in samples
    ) / len(samples)
    assert acc == want_acc
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]


def test_langchain_bind_tools_and_structured_output(server):
    url, state = server
    llm = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{url}/v1", api_key=API_KEY, temperature=0, max_tokens=64
    )
    bound = llm.bind_tools([WEATHER_TOOL, ADD_TOOL], tool_choice="add")
    reply = bound.invoke("What is 7 plus 8?")
    assert [c["name"] for c in reply.tool_calls] == ["add"]
    args = reply.tool_calls[0]["args"]
    assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    schema = {
        "title": "City",
        "description": "A city and its country",
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }
    for method in ("function_calling", "json_schema"):
        structured = llm.with_structured_output(schema, method=method)
        answer = structured.invoke("Name the capital of France and its country.")
        assert set(answer) == {"city", "country"}, (method, answer)
        assert all(isinstance(v, str) for v in answer.values())
    snap = wait_idle(state.engine)
    assert snap["num_free_blocks"] == snap["num_blocks"]
