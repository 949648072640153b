"""Qwen3 (engine/models/qwen3.py: the Llama decoder with an RMSNorm over each query and key
head, and a head size of its own): greedy token ids equal HF transformers' `generate()` through
the paged KV cache, prefix caching, chunked prefill, preemption, n-gram and draft-model
speculation, LoRA adapters, and the C++ layers over quantized weights."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from lora import LoRARequest
from models import hf_greedy, make_adapter, make_tiny_model, prompt_scores

NEW_TOKENS = 12
LENS = [1, 9, 17, 40, 130]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Head size 32 where hidden / heads is 16: a model that reads it from its config."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", head_dim=32)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 256, (24,), generator=g).tolist()
    out = [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENS]
    out += [shared + [7, 8, 9], shared + [7, 8, 9] * 4]  # a shared prefix; a repeated tail
    return out


@pytest.fixture(scope="module")
def want(qwen3) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32)
    assert hf.model.layers[0].self_attn.q_norm is not None
    return [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()]


def greedy(model_dir, **engine_args) -> list[list[int]]:
    llm = LLM(str(model_dir), **engine_args)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    snap = llm.engine.snapshot()
    assert snap["num_free_blocks"] == snap["num_blocks"]
    if engine_args.get("block_size") == 4:
        assert snap["num_preemptions"] > 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(num_kv_blocks=128),
        dict(num_kv_blocks=128, enable_prefix_caching=True, max_num_batched_tokens=7),
        dict(num_kv_blocks=48, block_size=4),  # preempted and recomputed
        dict(num_kv_blocks=128, speculative_method="ngram", num_speculative_tokens=3),
    ],
    ids=["batched", "prefix-cache-chunks", "preemption", "ngram"],
)
def test_qwen3_greedy_equals_hf(qwen3, want, engine_args):
    assert greedy(qwen3, **engine_args) == want


def test_qwen3_draft_model_is_lossless(qwen3, want, tmp_path):
    draft = make_tiny_model(tmp_path / "draft", "qwen3", seed=1, head_dim=32)
    assert greedy(qwen3, num_kv_blocks=128, draft_model=str(draft)) == want


def test_qwen3_adapters_equal_peft(qwen3, tmp_path):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    path = make_adapter(qwen3, tmp_path / "adapter", 3, 8, targets, {})
    llm = LLM(str(qwen3), num_kv_blocks=128, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    adapter = LoRARequest("a", str(path))
    outs = llm.generate(prompts(), params, use_tqdm=False, lora_request=adapter)
    got = [o.outputs[0].token_ids for o in outs]
    base = AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(path)).eval()
    with torch.no_grad():
        assert got == [hf_greedy(peft, p, NEW_TOKENS) for p in prompts()]


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
    broken = torch.cat([a - b for a, b in zip(prompt_scores(llm, seqs), want, strict=True)])
    assert broken.abs().mean() > 1  # 1.95 measured
