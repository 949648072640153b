"""The dense C++ layer (kernels/cpu/dense_layer.cpp): one call per decoder layer over float32
weights. It equals its pieces composed from Python bit for bit (as steps with adapters run
them), over plain and oneDNN-packed weights, with a QKV bias, MLP biases, per-head norms and
Gemma 3's layer (post norms, GELU-tanh, a sliding window);
it computes the torch reference's layer (to float32 rounding); `quantization=None` on CPU runs
through it; and steps with a LoRA adapter compose the pieces around the adapter instead."""

from __future__ import annotations

import pytest
import torch

from engine.attention import bucketed_metadata, row_metadata, slot_ids
from engine.models.layers import Dense, Packed, onednn_linear_available, projections
from engine.models.loader import load_model
from engine.models.quantized import tandem_kernel_available
from models import make_tiny_model

pytestmark = pytest.mark.skipif(not tandem_kernel_available(), reason="no C++ kernel")

BLOCK = 4
# Three requests: a prompt of 9 tokens, a decode token at 1, a chunk of 6 over 8 cached tokens
# (16 rows); or those and a chunk of 30 over 15 cached tokens (46 rows: the packed GEMM pads
# them to 48).
# Gemma 3 with heads of 32 (not its default 256) and a window of 8: both layers slide.
GEMMA3 = dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=24)
STEPS = {
    16: ([9, 1, 14], [9, 1, 6], [[1, 2, 3], [4], [5, 6, 7, 8]]),
    46: ([9, 1, 14, 45], [9, 1, 6, 30], [[1, 2, 3], [4], [5, 6, 7, 8], list(range(9, 21))]),
}


def step_inputs(model, seq_lens, query_lens, tables, seed: int = 0):
    """A step's rows (x [N, hidden]), their RoPE rows and slots."""
    slots = [
        s
        for table, total, n in zip(tables, seq_lens, query_lens, strict=True)
        for s in slot_ids(table, total - n, n, BLOCK)
    ]
    positions = torch.tensor(
        [p for total, n in zip(seq_lens, query_lens, strict=True) for p in range(total - n, total)]
    )
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots), model.config.hidden_size, generator=g)  # [N, hidden]
    cos, sin = model.rotary["global"](positions)  # [N, 1, D]
    return x, cos, sin, torch.tensor(slots)


def dense_model(tmp_path, arch: str, packed: bool, **kw):
    path = make_tiny_model(tmp_path / "tiny", arch, **kw)
    model, cfg, _ = load_model(path, quantization=None, pack_weights=packed)
    return model, cfg


@pytest.mark.parametrize("num_rows", [16, 46])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize(
    ("arch", "kw"),
    [("qwen2", {}), ("qwen3", {}), ("llama", {"mlp_bias": True}), ("gemma3", GEMMA3)],
    ids=["qkv-bias", "head-norms", "mlp-bias", "gemma3"],
)
def test_dense_layer_equals_its_pieces_composed(tmp_path, arch, kw, packed, num_rows):
    """The one call and the pieces composed from Python: the same hidden states and caches,
    bit for bit, over rows of a prompt, a decode token and a chunk after cached tokens."""
    if packed and not onednn_linear_available():
        pytest.skip("no oneDNN")
    model, cfg = dense_model(tmp_path, arch, packed, **kw)
    assert model.fused_layers
    layer = model.layers[0]
    fmt = Packed if packed else Dense
    assert all(isinstance(m.format, fmt) for m in projections(layer.self_attn, layer.mlp))
    assert layer.fused[0] == torch.ops.tandem_cpu.dense_layer
    biases = layer.fused[1][1]
    assert (biases[0] is not None) == cfg.qkv_bias and (biases[2] is not None) == cfg.mlp_bias
    seq_lens, query_lens, tables = STEPS[num_rows]
    x, cos, sin, slots = step_inputs(model, seq_lens, query_lens, tables)
    assert x.shape[0] == num_rows
    meta = row_metadata(seq_lens, query_lens, tables, slots, BLOCK)
    caches = torch.randn(2, cfg.num_kv_heads, 21, BLOCK, cfg.head_dim)  # earlier tokens' K, V
    fused_cache, composed_cache = caches.clone(), caches.clone()
    fused = layer(x.clone(), cos, sin, fused_cache, meta)
    call, layer.fused = layer.fused, None  # the pieces
    composed = layer(x.clone(), cos, sin, composed_cache, meta)
    layer.fused = call
    assert torch.equal(fused, composed)
    assert torch.equal(fused_cache, composed_cache)
    assert not torch.equal(fused_cache, caches)  # the step's keys and values were written
    assert not torch.equal(fused, x)


@pytest.mark.parametrize(("arch", "kw"), [("qwen2", {}), ("qwen3", {}), ("gemma3", GEMMA3)])
def test_dense_layer_computes_the_torch_reference_layer(tmp_path, arch, kw):
    """Whole prompts (every key written in the step, so each path reads only its own cache
    layout): the C++ layer's rows against the torch reference's (norms, RoPE, bucketed and
    prefill attention in torch; Gemma 3's window of 8 inside the 9-token prompt), to float32
    rounding; a layer whose RoPE is cut to no rotation is far outside that tolerance."""
    model, cfg = dense_model(tmp_path, arch, packed=True, **kw)
    layer = model.layers[1]
    seq_lens, tables = [9, 1, 5], [[1, 2, 3], [4], [5, 6]]
    x, cos, sin, slots = step_inputs(model, seq_lens, seq_lens, tables, seed=1)
    caches = torch.zeros(2, cfg.num_kv_heads, 7, BLOCK, cfg.head_dim)
    rows = row_metadata(seq_lens, seq_lens, tables, slots, BLOCK)
    window = layer.self_attn.window or None
    reference = bucketed_metadata(seq_lens, seq_lens, tables, slots, BLOCK, window)
    fused = layer(x.clone(), cos, sin, caches.clone(), rows)
    want = layer(x.clone(), cos, sin, caches.clone(), reference)
    torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)
    unrotated = layer(x.clone(), torch.ones_like(cos), torch.zeros_like(sin), caches.clone(), rows)
    assert not torch.allclose(unrotated, want, rtol=1e-3, atol=1e-3)


def test_engine_runs_dense_weights_through_the_dense_layer_on_the_torch_backend(tiny_qwen2):
    from engine import LLM

    llm = LLM(str(tiny_qwen2), quantization=None, num_kv_blocks=16)
    model = llm.engine.runner.model
    assert model.fused_layers
    assert all(layer.fused[0] == torch.ops.tandem_cpu.dense_layer for layer in model.layers)
    # The Triton backend (its interpreter here) attends the rows itself: no C++ layers.
    triton = LLM(str(tiny_qwen2), quantization=None, num_kv_blocks=16, attention_backend="triton")
    model = triton.engine.runner.model
    assert not model.fused_layers and all(layer.fused is None for layer in model.layers)


def test_adapter_steps_compose_the_pieces_and_equal_peft(tmp_path, tiny_llama):
    """Every step has an adapter row: the layers never make the one call (a call that raises
    stands in for it) and the tokens are PEFT's, which differ from the base model's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from lora import LoRARequest
    from models import hf_greedy, make_adapter

    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    adapter = make_adapter(tiny_llama, tmp_path / "adapter", 3, 8, targets, {})
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    prompts = [[5, 77, 120, 3], [200, 14, 9, 31, 66, 150, 2]]
    with torch.no_grad():
        plain = [hf_greedy(base, p, 12) for p in prompts]
        hf = PeftModel.from_pretrained(base, str(adapter)).eval()
        want = [hf_greedy(hf, p, 12) for p in prompts]
    assert want != plain

    llm = LLM(str(tiny_llama), quantization=None, num_kv_blocks=64, enable_lora=True)
    model = llm.engine.runner.model
    assert model.fused_layers

    def refuse(*args):
        raise AssertionError("the one-call layer ran a step with an adapter")

    for layer in model.layers:
        layer.fused = (refuse, layer.fused[1])
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    outs = llm.generate(
        prompts, params, use_tqdm=False, lora_request=LoRARequest("a", str(adapter))
    )
    assert [o.outputs[0].token_ids for o in outs] == want
