"""Phi-3 and Phi-4-mini (engine/models/phi3.py: Q/K/V and gate/up fused in the checkpoint, a
sliding window, LongRoPE, partial rotary): greedy token ids equal HF transformers' `generate()`
through the paged KV cache, prefix caching, chunked prefill, preemption, n-gram and
draft-model speculation, LoRA adapters on the fused projections, and the C++ layers over
quantized weights."""

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
ORIGINAL = 64  # the Phi-4-mini-like model's original context: LongRoPE's short factors below


def prompts(lens=(1, 9, 17, 40, 130)) -> list[list[int]]:
    return parity_prompts(5, lens)


def phi4_mini_like(path, seed: int = 0):
    """Partial rotary (12 of 16 dims), LongRoPE with distinct short and long factors, tied
    embeddings: Phi-4-mini's shape in small."""
    g = torch.Generator().manual_seed(seed + 7)
    short, long = (1.0 + torch.rand(6, generator=g) * s for s in (0.5, 4.0))
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": short.tolist(),
        "long_factor": long.tolist(),
    }
    return make_tiny_model(
        path, "phi3", seed=seed, rope_parameters=rope, tie_word_embeddings=True,
        original_max_position_embeddings=ORIGINAL,
    )  # fmt: skip


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """Phi-3-mini's shape in small: every layer with a sliding window (24 here)."""
    return make_tiny_model(tmp_path_factory.mktemp("phi3"), "phi3", sliding_window=24)


@pytest.fixture(scope="module")
def phi4(tmp_path_factory):
    return phi4_mini_like(tmp_path_factory.mktemp("phi4"))


def hf_of(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def want(phi3) -> list[list[int]]:
    hf = hf_of(phi3)
    return [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()]


def greedy(model_dir, seqs=None, **engine_args) -> list[list[int]]:
    return engine_greedy(model_dir, seqs or prompts(), NEW_TOKENS, **engine_args)


@pytest.mark.parametrize("engine_args", PARITY_ENGINES, ids=PARITY_IDS)
def test_phi3_greedy_equals_hf(phi3, want, engine_args):
    assert greedy(phi3, **engine_args) == want


def test_phi3_window_matters(phi3, want, tmp_path):
    """The broken variant: the same weights without the window give other tokens."""
    import json

    config = json.loads((phi3 / "config.json").read_text())
    unwindowed = tmp_path / "unwindowed"
    unwindowed.mkdir()
    for f in phi3.iterdir():
        (unwindowed / f.name).symlink_to(f)
    (unwindowed / "config.json").unlink()
    (unwindowed / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    assert greedy(unwindowed, num_kv_blocks=128) != want


def test_phi3_draft_model_is_lossless(phi3, want, tmp_path):
    draft = make_tiny_model(tmp_path / "draft", "phi3", seed=1, sliding_window=24)
    assert greedy(phi3, num_kv_blocks=128, draft_model=str(draft)) == want


def test_phi3_adapters_on_fused_projections_equal_peft(phi3, tmp_path):
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    got, want = adapter_greedy_and_peft(phi3, targets, prompts(), NEW_TOKENS, tmp_path)
    assert got == want


def test_phi4_mini_partial_rotary_and_longrope_equal_hf(phi4):
    """Within the original context the engine (max_model_len 64) takes the short factors, as HF
    does for any sequence that fits; prompts past it take the long factors in both (the
    engine's default context is 512)."""
    hf = hf_of(phi4)
    short, long = prompts((1, 9, 17, 40)), prompts((70, 100))[:2]
    want_short = [hf_greedy(hf, p, NEW_TOKENS) for p in short]
    want_long = [hf_greedy(hf, p, NEW_TOKENS) for p in long]
    assert greedy(phi4, short, num_kv_blocks=128, max_model_len=ORIGINAL) == want_short
    assert greedy(phi4, long, num_kv_blocks=128) == want_long
    # The broken variant: the short prompts on the long factors (HF rotates them with short).
    assert greedy(phi4, short, num_kv_blocks=128) != want_short


def test_phi4_mini_cpp_layers_over_int8_weights(phi4):
    """quantization="int8": every row through the one-call C++ layer (partial rotary included)
    scores HF's greedy continuations within 0.1 nats per token on average of HF on the same
    int8-rounded weights; the same layers rotating every dim are off by far more."""
    from engine.models.quantized import QuantizedWeight

    llm = LLM(
        str(phi4), num_kv_blocks=128, quantization="int8", enable_prefix_caching=False,
        max_model_len=ORIGINAL,
    )  # fmt: skip
    model = llm.engine.runner.model
    assert model.fused_layers and all(layer.fused is not None for layer in model.layers)
    hf = hf_of(phi4)
    seqs = prompts((1, 9, 17, 40))
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2 and p.shape[1] % 32 == 0:
                p.copy_(QuantizedWeight.quantize(p, 8).dequantize())
        seqs = [p + hf_greedy(hf, p, NEW_TOKENS) for p in seqs]
        want = [
            hf(torch.tensor([s]))
            .logits[0, :-1]
            .log_softmax(-1)
            .gather(1, torch.tensor(s[1:])[:, None])[:, 0]
            for s in seqs
        ]
    errors = torch.cat([a - b for a, b in zip(prompt_scores(llm, seqs), want, strict=True)])
    assert errors.abs().mean() < 0.1 and errors.abs().max() < 0.5  # 0.058 and 0.39 measured
    for layer in model.layers:  # the broken variant: every dim rotated
        layer.self_attn.rotary_dim = layer.self_attn.head_dim
    model.fuse()  # the one-call stack reads the layers again
    broken = torch.cat([a - b for a, b in zip(prompt_scores(llm, seqs), want, strict=True)])
    assert broken.abs().mean() > 0.5  # 2.36 measured
