"""The SmolLM2 server the server tests share (one per package run), and its offline twin."""

from __future__ import annotations

import openai
import pytest
from web import API_KEY, make_state, serving

from engine import LLM
from engine.entrypoints.openai.server import build_app
from playground.demo_adapters import write_demo_adapters

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="package")
def demo_adapters():
    return write_demo_adapters(MODEL)


@pytest.fixture(scope="package")
def smol(demo_adapters):
    """SmolLM2 with n-gram speculation and two adapters, behind an API key. Exact weights:
    tokens are compared with offline decoding without speculation (quantized weights may
    resolve a bf16 near-tie differently in a verification step)."""
    state = make_state(
        MODEL,
        demo_adapters,
        quantization=None,
        num_kv_blocks=512,
        speculative_method="ngram",
        enable_lora=True,
        max_model_len=2048,
        show_cached_tokens=True,
    )
    with serving(build_app(state)) as url:
        yield url, state
    state.engine.shutdown()


@pytest.fixture(scope="package")
def client(smol):
    return openai.OpenAI(base_url=smol[0] + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="package")
def offline(demo_adapters):
    """The same model offline, without speculation: the reference outputs."""
    return LLM(
        MODEL,
        quantization=None,
        num_kv_blocks=512,
        enable_lora=True,
        num_threads=1,
        max_model_len=2048,
    )
