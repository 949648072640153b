"""Qwen3 (engine/models/qwen3.py: the Llama decoder with an RMSNorm over each query and key
head, and a head size of its own): greedy token ids equal HF transformers' `generate()` through
the paged KV cache, prefix caching, chunked prefill, preemption, n-gram and draft-model
speculation, LoRA adapters, and the C++ layers over quantized weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM
from models import (
    PARITY_ENGINES,
    PARITY_IDS,
    adapter_greedy_and_peft,
    engine_greedy,
    hf_greedy,
    make_tiny_model,
    parity_prompts,
    prompt_scores,
)

NEW_TOKENS = 12
LENS = [1, 9, 17, 40, 130]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Head size 32 where hidden / heads is 16: a model that reads it from its config."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", head_dim=32)


def prompts() -> list[list[int]]:
    return parity_prompts(5, LENS)


@pytest.fixture(scope="module")
def want(qwen3) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32)
    assert hf.model.layers[0].self_attn.q_norm is not None
    return [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()]


def greedy(model_dir, **engine_args) -> list[list[int]]:
    return engine_greedy(model_dir, prompts(), NEW_TOKENS, **engine_args)


@pytest.mark.parametrize("engine_args", PARITY_ENGINES, ids=PARITY_IDS)
def test_qwen3_greedy_equals_hf(qwen3, want, engine_args):
    assert greedy(qwen3, **engine_args) == want


def test_qwen3_draft_model_is_lossless(qwen3, want, tmp_path):
    draft = make_tiny_model(tmp_path / "draft", "qwen3", seed=1, head_dim=32)
    assert greedy(qwen3, num_kv_blocks=128, draft_model=str(draft)) == want


def test_qwen3_adapters_equal_peft(qwen3, tmp_path):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    got, want = adapter_greedy_and_peft(qwen3, targets, prompts(), NEW_TOKENS, tmp_path)
    assert got == want


def test_qwen3_cpp_layers_over_int8_weights(qwen3):
    """quantization="int8": every row through the C++ layers (head norms included) scores
    HF's greedy continuations within 0.1 nats per token on average (0.5 at most) of HF on the
    same int8-rounded weights (the activations' int8 rounding is the difference); the same
    layers without the head norms are off by more than 1 on average."""
    from engine.models.quantized import QuantizedWeight

    llm = LLM(str(qwen3), num_kv_blocks=128, quantization="int8", enable_prefix_caching=False)
    assert llm.engine.runner.model.fused_layers
    hf = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32)
    with torch.no_grad():  # HF on the weights the engine holds (projections and embedding)
        for p in hf.parameters():
            if p.dim() == 2 and p.shape[1] % 32 == 0:
                p.copy_(QuantizedWeight.quantize(p, 8).dequantize())
        seqs = [p + hf_greedy(hf, p, NEW_TOKENS) for p in prompts()]
        want = [
            hf(torch.tensor([s]))
            .logits[0, :-1]
            .log_softmax(-1)
            .gather(1, torch.tensor(s[1:])[:, None])[:, 0]
            for s in seqs
        ]
    errors = torch.cat([a - b for a, b in zip(prompt_scores(llm, seqs), want, strict=True)])
    assert errors.abs().mean() < 0.1 and errors.abs().max() < 0.5  # 0.034 and 0.14 measured
    for layer in llm.engine.runner.model.layers:  # the broken variant: no head norms
        layer.self_attn.head_norms = lambda: (None, None, 0.0)
    llm.engine.runner.model.fuse()  # the one-call stack reads the layers again
    broken = torch.cat([a - b for a, b in zip(prompt_scores(llm, seqs), want, strict=True)])
    assert broken.abs().mean() > 1  # 1.95 measured
