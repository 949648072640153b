"""Greedy token ids equal HF transformers `generate()` exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from models import hf_greedy, make_tiny_model

PROMPT_LENS = [1, 2, 15, 16, 17, 33, 100, 250, 488]
NEW_TOKENS = 20


def random_prompts(lens: list[int], seed: int = 0, high: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, high, (n,), generator=g).tolist() for n in lens]


def check_parity(model_dir, prompts, new_tokens=NEW_TOKENS, **engine_args):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    llm = LLM(str(model_dir), **engine_args)
    # min_tokens == HF min_new_tokens: EOS is banned the same way on both sides.
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, new_tokens), len(prompt)
    pool = llm.engine.kv.pool
    assert pool.num_free == pool.num_usable


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_parity_batched(arch, tiny_llama, tiny_qwen2):
    model_dir = tiny_llama if arch == "llama" else tiny_qwen2
    check_parity(model_dir, random_prompts(PROMPT_LENS), num_kv_blocks=400)


def test_tiny_parity_near_max_len(tiny_llama):
    """Prompt + output reaches max_position_embeddings - 1 (512 - 1)."""
    check_parity(tiny_llama, random_prompts([490], seed=3), new_tokens=21, num_kv_blocks=64)


def test_mistral_sliding_window_parity(tmp_path):
    model_dir = make_tiny_model(tmp_path, "mistral", sliding_window=24)
    check_parity(model_dir, random_prompts([5, 30, 70], seed=2), num_kv_blocks=64)


def test_qwen2_untied_bias_loaded(tiny_qwen2):
    llm = LLM(str(tiny_qwen2), num_kv_blocks=8)
    cfg = llm.engine.model_config
    assert cfg.qkv_bias and not cfg.tie_word_embeddings


def test_smollm2_parity_real_prompts():
    llm = LLM("smollm2-135m-instruct", quantization=None, num_kv_blocks=256)
    hf = AutoModelForCausalLM.from_pretrained(_smollm2_dir(), dtype=torch.float32)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    chat = llm.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    prompts.append(chat)
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)
    assert "4" in outs[-1].outputs[0].text


def _smollm2_dir():
    from engine.models.registry import resolve_model

    return resolve_model("smollm2-135m-instruct")
