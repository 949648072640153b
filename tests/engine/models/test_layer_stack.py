"""A model's decoder layers as one C++ call (engine/models/layer_stack.py): the same hidden
states and caches, bit for bit, as the layers called one by one, for every kind of layer the
stack takes (a QKV bias, per-head norms, Gemma 3's post norms, GELU, windows and two RoPE
tables) and every cache type; steps the stack does not take (adapters) go layer by layer."""

from __future__ import annotations

import pytest
import torch

from engine.models.quantized import tandem_kernel_available
from kernels import kv_int8

pytestmark = pytest.mark.skipif(not tandem_kernel_available(), reason="no C++ kernel")

GEMMA3 = dict(
    head_dim=32,
    sliding_window=8,
    query_pre_attn_scalar=24,
    num_hidden_layers=3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)


def tiny_llm(tmp_path, arch: str, kv_cache_dtype: str):
    from engine import LLM
    from models import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny", arch, **(GEMMA3 if arch == "gemma3" else {}))
    return LLM(
        str(path), quantization="int4", num_kv_blocks=16, block_size=4,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip


def cloned(caches):
    from engine.models.kv_cache import Int8Caches

    if isinstance(caches, Int8Caches):
        return Int8Caches(caches.k.clone(), caches.v.clone())
    return caches.clone()


def tensors(caches) -> list[torch.Tensor]:
    return [caches.k, caches.v] if hasattr(caches, "k") else [caches]


@pytest.mark.parametrize(
    "kv_cache_dtype,widths",
    [("auto", 4), ("int8", 4), ("bfloat16", 4), ("auto", "segments")],  # segments: mixed widths
)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_the_stack_equals_the_layers_one_by_one(tmp_path, arch, kv_cache_dtype, widths):
    from quant_blocks import requantize_layer

    from engine.attention import row_metadata, slot_ids

    llm = tiny_llm(tmp_path, arch, kv_cache_dtype)
    model = llm.engine.runner.model
    if widths == "segments":  # projections of segments in every layer (quant_blocks)
        for layer in model.layers:
            requantize_layer(layer, widths)
        assert model.fuse() and model.layers[-1].fused[1][3] == [2, 1, 2, 1]
    stack = model.stack
    assert stack is not None and stack.num_layers == len(model.layers)
    if arch == "gemma3":  # both kinds of RoPE in play
        assert stack.ropes == ["global", "local"] and {lay.rope for lay in model.layers} == {
            "global",
            "local",
        }
    # three requests: a prompt chunk, a decode row, a chunk after a cached prefix
    seq_lens, query_lens, tables = [9, 1, 14], [9, 1, 6], [[1, 2, 3], [4], [5, 6, 7, 8]]
    slots = [
        s
        for table, total, n in zip(tables, seq_lens, query_lens, strict=True)
        for s in slot_ids(table, total - n, n, 4)
    ]
    meta = row_metadata(seq_lens, query_lens, tables, torch.tensor(slots), 4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (len(slots),), generator=g)
    positions = meta.seq_lens - 1  # each row's own
    caches = cloned(llm.engine.runner.kv_caches)
    num_kv_heads, d = model.layers[0].self_attn.num_kv_heads, model.config.head_dim
    for layer in range(len(model.layers)):  # earlier tokens' keys and values
        rows = torch.randn(2, 16 * 4, num_kv_heads, d, generator=g)
        if kv_cache_dtype == "int8":  # codes and scales as stored
            kv_int8.store(caches.k[layer], caches.v[layer], *rows, torch.arange(16 * 4))
        else:  # [2, Hkv, blocks, block_size, D]
            caches[layer].copy_(rows.view(2, 16, 4, num_kv_heads, d).permute(0, 3, 1, 2, 4))
    by_stack, by_layer = cloned(caches), cloned(caches)
    with torch.inference_mode():
        stacked = model(ids, positions, by_stack, meta)
        model.stack = None
        layered = model(ids, positions, by_layer, meta)
    model.stack = stack
    assert not stacked.isnan().any() and torch.equal(stacked, layered)
    assert all(map(torch.equal, tensors(by_stack), tensors(by_layer)))
    assert not all(map(torch.equal, tensors(by_stack), tensors(caches)))  # the step wrote


def test_steps_with_adapters_and_non_row_layouts_go_layer_by_layer(tmp_path):
    from engine.attention import RowAttention

    llm = tiny_llm(tmp_path, "llama", "auto")
    stack = llm.engine.runner.model.stack
    meta = RowAttention(*(torch.zeros(1, dtype=torch.long) for _ in range(4)))
    assert stack.runs(meta, None)
    assert not stack.runs(meta, lora=object())
    assert not stack.runs({"not": "rows"}, None)


def test_a_model_off_the_quantized_kernel_has_no_stack(tmp_path):
    from engine import LLM
    from models import make_tiny_model

    llm = LLM(str(make_tiny_model(tmp_path / "tiny", "llama")), quantization=None)
    assert llm.engine.runner.model.stack is None


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_decode_equals_steps_through_the_model_and_its_head(tmp_path, arch, kv_cache_dtype):
    """The stack's decode (embedding to argmax in C++, S steps each fed the last one's picks)
    gives the tokens and caches of S steps of forward, the LM head and argmax_rows."""
    from engine.attention import row_metadata, slot_ids
    from engine.sampler import argmax_rows

    llm = tiny_llm(tmp_path, arch, kv_cache_dtype)
    model = llm.engine.runner.model
    stack, vocab = model.stack, model.config.vocab_size
    assert stack.decodes
    tables, steps = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], 3
    starts = [7, 2, 11]  # each request's context before the first step (keys below)
    g = torch.Generator().manual_seed(1)
    caches = cloned(llm.engine.runner.kv_caches)
    num_kv_heads, d = model.layers[0].self_attn.num_kv_heads, model.config.head_dim
    for layer in range(len(model.layers)):
        rows = torch.randn(2, 16 * 4, num_kv_heads, d, generator=g)
        if kv_cache_dtype == "int8":
            kv_int8.store(caches.k[layer], caches.v[layer], *rows, torch.arange(16 * 4))
        else:
            caches[layer].copy_(rows.view(2, 16, 4, num_kv_heads, d).permute(0, 3, 1, 2, 4))
    ids = torch.randint(0, vocab, (3,), generator=g)
    positions = torch.tensor(starts)
    slots = torch.tensor([slot_ids(t, s, steps, 4) for t, s in zip(tables, starts, strict=True)])
    by_decode, by_steps = cloned(caches), cloned(caches)
    ones = [1, 1, 1]
    with torch.inference_mode():
        width = max(map(len, tables))  # each row's blocks, padded with the null block
        flat = [b for t in tables for b in t + [0] * (width - len(t))]
        tokens, is_nan = stack.decode(
            ids.tolist(), starts, by_decode, slots.flatten().tolist(), flat
        )
        expected, step_ids = [], ids
        for s in range(steps):
            lens = [p + s + 1 for p in starts]
            meta_s = row_metadata(lens, ones, tables, slots[:, s].contiguous(), 4)
            hidden = model(step_ids, positions + s, by_steps, meta_s)
            step_ids, nan = argmax_rows(model.lm_head(hidden)[:, :vocab])
            assert not nan.any()
            expected.append(step_ids)
    assert torch.equal(tokens, torch.stack(expected, dim=1)) and not is_nan.any()
    assert all(map(torch.equal, tensors(by_decode), tensors(by_steps)))
    assert not all(map(torch.equal, tensors(by_decode), tensors(caches)))
