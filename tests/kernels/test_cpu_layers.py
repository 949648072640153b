"""The C++ layers' pieces (kernels/cpu/fused_layer.cpp): RoPE and the cache write, attention
over each row's own context against softmax attention in float64, a row's bits independent of
the rows beside it, and the fused call equal to the same pieces composed from Python. The int8
KV cache (kernels/cpu/kv_int8.h) against its torch reference (kernels/kv_int8.py): rope_store
writes the reference's bytes, attend over the codes equals softmax attention over the
dequantized rows, and a row is within half a step of what was stored."""

from __future__ import annotations

import pytest
import torch

from engine.models.layers import apply_rope
from engine.models.quantized import tandem_kernel_available
from kernels import kv_int8
from kernels.reference import causal_mask

pytestmark = pytest.mark.skipif(not tandem_kernel_available(), reason="no C++ kernel")


def requests_in_cache(heads, block_size: int, lens: list[int], seed: int = 0):
    """Every token of len(lens) requests rotated and stored by rope_store on scattered blocks.
    Returns (qkv rotated [T, cols], caches, tables [R, W], row_tables [T], seq_lens [T])."""
    num_heads, num_kv_heads, d = heads
    g = torch.Generator().manual_seed(seed)
    cols = (num_heads + 2 * num_kv_heads) * d
    total = sum(lens)
    qkv = torch.randn(total, cols, generator=g)
    widths = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(widths)
    order = 1 + torch.randperm(num_blocks - 1, generator=g)  # block 0 stays the null block
    tables = torch.zeros(len(lens), max(widths), dtype=torch.long)
    positions, slots, row_tables, seq_lens, used = [], [], [], [], 0
    for i, n in enumerate(lens):
        tables[i, : widths[i]] = order[used : used + widths[i]]
        used += widths[i]
        for p in range(n):
            positions.append(p)
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
            row_tables.append(i)
            seq_lens.append(p + 1)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    freqs = torch.tensor(positions).float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos(), emb.sin()
    k_cache = torch.zeros(num_kv_heads, num_blocks, block_size, d)
    v_cache = torch.zeros_like(k_cache)
    raw = qkv.clone()
    torch.ops.tandem_cpu.rope_store(
        qkv, cos, sin, k_cache, v_cache, torch.tensor(slots), num_heads, num_kv_heads
    )
    q_size, kv_size = num_heads * d, num_kv_heads * d
    for start, heads_of in ((0, num_heads), (q_size, num_kv_heads)):  # q and k rotated as HF
        part = raw[:, start : start + heads_of * d].view(total, heads_of, d)
        want = apply_rope(part, cos[:, None], sin[:, None], d).reshape(total, -1)
        torch.testing.assert_close(qkv[:, start : start + heads_of * d], want)
    assert torch.equal(qkv[:, q_size + kv_size :], raw[:, q_size + kv_size :])  # v as it came
    rows = (torch.tensor(row_tables), torch.tensor(seq_lens))
    return qkv, (k_cache, v_cache), tables, *rows


def reference_attention(qkv, heads, lens, scale, window):  # [T, Hq * D] in float64
    num_heads, num_kv_heads, d = heads
    q_size, kv_size = num_heads * d, num_kv_heads * d
    out, start = [], 0
    for n in lens:
        rows = qkv[start : start + n].double()
        q = rows[:, :q_size].view(n, num_heads, d).transpose(0, 1)
        k = rows[:, q_size : q_size + kv_size].view(n, num_kv_heads, d).transpose(0, 1)
        v = rows[:, q_size + kv_size :].view(n, num_kv_heads, d).transpose(0, 1)
        group = num_heads // num_kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = (q @ k.transpose(1, 2)) * scale
        scores.masked_fill_(~causal_mask(0, n, window or None), float("-inf"))
        out.append((scores.softmax(-1) @ v).transpose(0, 1).reshape(n, q_size))
        start += n
    return torch.cat(out)


def attend(qkv, caches, tables, row_tables, seq_lens, heads, scale, window):
    num_heads, num_kv_heads, d = heads
    return torch.ops.tandem_cpu.attend(
        qkv, caches[0], caches[1], tables, row_tables, seq_lens, num_heads, num_kv_heads, d,
        scale, window,
    )  # fmt: skip


@pytest.mark.parametrize("block_size", [4, 8, 12, 16])
# groups of 1-10 query heads per key head: the kernel scores up to eight heads per load of
# the keys and sums up to three heads' values per load of the values (D = 64), in passes
@pytest.mark.parametrize(
    "heads", [(3, 1, 8), (6, 2, 64), (4, 4, 16), (14, 2, 64), (12, 1, 128), (20, 2, 64)]
)
@pytest.mark.parametrize("window", [0, 7])
def test_attend_equals_softmax_attention_and_each_row_stands_alone(block_size, heads, window):
    lens = [1, 19, 45]
    qkv, caches, tables, row_tables, seq_lens = requests_in_cache(heads, block_size, lens)
    scale = heads[2] ** -0.5
    args = (caches, tables)
    got = attend(qkv, *args, row_tables, seq_lens, heads, scale, window)
    want = reference_attention(qkv, heads, lens, scale, window).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a row's bits alone, or with any other rows (decode, a chunk, a cache hit's short query)
    for rows in ([0], [30], [64, 3, 40], list(range(20, 64, 5))):
        part = attend(
            qkv[rows], *args, row_tables[rows], seq_lens[rows], heads, scale, window
        )  # fmt: skip
        assert torch.equal(part, got[rows]), rows


@pytest.mark.parametrize("heads", [(9, 3, 64), (14, 2, 64), (12, 1, 128), (4, 4, 16)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 7])
def test_attend_bits_do_not_depend_on_the_block_size(heads, kv_dtype, window):
    """The same requests in caches of 8-, 12-, 16- and 32-token blocks give the same bits:
    each score is one chain over the head dimension and each output element one over the
    keys, whether a load holds 8 keys (the 256-bit path, any block size) or 16 (AVX-512,
    blocks of a multiple of 16; SmolLM2's 9 x 3 x 64 among the shapes), windowed or not."""
    lens = [1, 19, 45, 70]
    got = {}
    for block_size in (8, 12, 16, 32):
        qkv, caches, tables, row_tables, seq_lens = requests_in_cache(heads, block_size, lens)
        caches = tuple(c.to(kv_dtype) for c in caches)
        scale = heads[2] ** -0.5
        got[block_size] = attend(qkv, caches, tables, row_tables, seq_lens, heads, scale, window)
    for block_size in (12, 16, 32):
        assert torch.equal(got[block_size], got[8]), block_size


def test_partial_rotary_rotates_the_first_dims_as_hf_and_passes_the_rest():
    """Phi-4-mini's partial rotary (24 of 32 dims here): rope_store and the torch path both
    equal HF's apply_rotary_pos_emb; the broken variant (rotating all 32) does not."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    from engine.models.layers import RotaryTables

    num_heads, num_kv_heads, d, rotary, n = 2, 1, 32, 24, 5
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * d, generator=g)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary, 2).float() / rotary)
    tables = RotaryTables(inv_freq, 1.0, 16, d)  # (unplaced: rope_rows)
    positions = torch.tensor([0, 3, 7, 11, 15])
    cos, sin = (t[:, 0] for t in tables(positions))  # [n, d]
    q = qkv[:, : num_heads * d].view(n, num_heads, d)
    k = qkv[:, num_heads * d : (num_heads + num_kv_heads) * d].view(n, num_kv_heads, d)
    hf_cos, hf_sin = cos[None, :, :rotary], sin[None, :, :rotary]  # HF's: [1, n, rotary]
    want_q, want_k = (
        t[0].transpose(0, 1)
        for t in apply_rotary_pos_emb(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin
        )
    )
    assert torch.equal(apply_rope(q, cos[:, None], sin[:, None], rotary), want_q)
    k_cache = torch.zeros(num_kv_heads, 4, 4, d)
    v_cache = torch.zeros_like(k_cache)
    for width, equal in ((rotary, True), (d, False)):
        out = qkv.clone()
        torch.ops.tandem_cpu.rope_store(
            out, cos, sin, k_cache, v_cache, torch.arange(n), num_heads, num_kv_heads,
            None, None, 0.0, width,
        )  # fmt: skip
        got_q = out[:, : num_heads * d].view(n, num_heads, d)
        got_k = out[:, num_heads * d : (num_heads + num_kv_heads) * d].view(n, num_kv_heads, d)
        assert torch.allclose(got_q, want_q, atol=1e-6) is equal
        assert torch.allclose(got_k, want_k, atol=1e-6) is equal
        if equal:
            assert torch.equal(got_q[..., rotary:], q[..., rotary:])  # passed through as is


@pytest.mark.parametrize(("base", "rotary"), [(10_000.0, 256), (1_000_000.0, 256), (10_000.0, 24)])
def test_rope_rows_are_the_table_rows_within_an_ulp_and_stand_alone(base, rotary):
    """rope_rows (each step's cos and sin from its positions, no table) against the table of
    every position torch builds elsewhere, at Gemma 3's two bases over its 32k context and a
    partial rotary (24 of 32 dims): within one float32 ulp (glibc's cosf and sinf against
    torch's vectorized ones; 95-96% of entries equal measured, and rope_rows' the closer to
    float64's: 98.7% correctly rounded against 95.3%); a row's values are the same alone or
    among others; the broken variant (positions off by one) is far outside."""
    from engine.models.layers import RotaryTables

    d = max(rotary, 32)
    inv_freq = 1.0 / base ** (torch.arange(0, rotary, 2).float() / rotary)
    tables = RotaryTables(inv_freq, 1.0, 32768, d)
    positions = torch.arange(32768)
    got = tables(positions)  # (unplaced: rope_rows)
    tables.place(torch.device("cpu"), torch.float64)  # the table, as built for other devices
    want = tables(positions)
    for g, w in zip(got, want, strict=True):
        assert g.shape == (32768, 1, d) and g.dtype == torch.float32
        w = w.float()
        assert (g - w).abs().le(torch.finfo(torch.float32).eps * w.abs()).all()  # an ulp
        assert g.eq(w).float().mean() > 0.9
        assert torch.equal(g[:, 0, rotary:], w[:, 0, rotary:])  # cos 1, sin 0
    rows = torch.tensor([31000, 5, 17, 5])
    for g, part in zip(got, RotaryTables(inv_freq, 1.0, 32768, d)(rows), strict=True):
        assert torch.equal(part, g[rows])
    shifted = RotaryTables(inv_freq, 1.0, 32768, d)(positions + 1)[0]
    assert not torch.allclose(shifted[:, 0, :rotary], got[0][:, 0, :rotary], atol=1e-2)


def test_attend_refuses_a_context_beyond_its_table():
    heads = (2, 1, 8)
    qkv, caches, tables, row_tables, seq_lens = requests_in_cache(heads, 4, [6])
    with pytest.raises(RuntimeError, match="beyond its block table"):
        attend(qkv[:1], caches, tables, row_tables[:1], seq_lens[:1] + 8, heads, 1.0, 0)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "bfloat16"])
# a QKV bias; per-head norms; Gemma 3's (post norms, GELU-tanh, a window of 8, heads of 32)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
# 5, 6: a 4-bit plane and one per higher bit; "segments": projections of mixed widths (q, k
# at 4 bits beside v at 8, gate at 4 beside up at 6), as Q4_K_M files mix their types
@pytest.mark.parametrize("bits", [4, 5, 6, "segments"])
def test_fused_layer_equals_its_pieces_composed(tmp_path, arch, kv_cache_dtype, bits):
    """A layer's one C++ call and its pieces composed from Python (as steps with adapters or
    tensor-parallel sums run them): the same hidden states and caches, bit for bit, with a
    float32 cache, an int8 one or a bfloat16 one."""
    from quant_blocks import requantize_layer

    from engine import LLM
    from engine.attention import row_metadata, slot_ids
    from models import make_tiny_model

    gemma3 = dict(head_dim=32, sliding_window=8, query_pre_attn_scalar=24)
    path = make_tiny_model(tmp_path / "tiny", arch, **(gemma3 if arch == "gemma3" else {}))
    llm = LLM(
        str(path),
        quantization="int4",
        num_kv_blocks=16,
        block_size=4,
        kv_cache_dtype=kv_cache_dtype,
    )
    model = llm.engine.runner.model
    assert model.fused_layers
    layer = model.layers[0]
    assert layer.fused[0] == torch.ops.tandem_cpu.fused_layer
    if bits != 4:  # requantized from its int4 values to wider codes, or mixed widths
        requantize_layer(layer, bits)
        mixed = {"segments": ([4, 8, 4, 4, 6, 4], [2, 1, 2, 1])}
        widths, parts = mixed.get(bits, ([bits] * 4, [1] * 4))
        assert layer.fused[1][1] == widths and layer.fused[1][3] == parts
    seq_lens, query_lens, tables = [9, 1, 14], [9, 1, 6], [[1, 2, 3], [4], [5, 6, 7, 8]]
    slots = [
        s
        for table, total, n in zip(tables, seq_lens, query_lens, strict=True)
        for s in slot_ids(table, total - n, n, 4)
    ]
    meta = row_metadata(seq_lens, query_lens, tables, torch.tensor(slots), 4)
    n = len(slots)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, model.config.hidden_size, generator=g)
    positions = meta.seq_lens - 1
    cos, sin = model.rotary["global"](positions)
    caches = list(llm.engine.runner.kv_caches[0])  # K, V (int8: rows of their own widths)
    if kv_cache_dtype == "int8":  # rows of earlier tokens: codes and scales as stored
        num_kv_heads, d = caches[0].shape[0], model.config.head_dim
        rows = torch.randn(2, 16 * 4, num_kv_heads, d, generator=g)
        caches = [c.clone() for c in caches]
        kv_int8.store(*caches, *rows, torch.arange(16 * 4))
        assert caches[0].dtype == caches[1].dtype == torch.int8
        assert caches[0].shape[-1] == kv_int8.row_bytes(d, True) > caches[1].shape[-1]
    else:
        caches = [torch.randn_like(c) for c in caches]
    fused_cache, composed_cache = ([c.clone() for c in caches] for _ in range(2))
    fused = layer(x.clone(), cos, sin, fused_cache, meta)
    call, layer.fused = layer.fused, None  # the pieces
    composed = layer(x.clone(), cos, sin, composed_cache, meta)
    layer.fused = call
    assert torch.equal(fused, composed)
    assert all(map(torch.equal, fused_cache, composed_cache))
    # the step's keys and values were written
    assert not any(map(torch.equal, fused_cache, caches))


def test_a_value_is_within_half_a_step_and_zero_and_nan_groups_are_kept_apart():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 64, generator=g) * torch.rand(50, 1, generator=g) * 10
    x[3] = 0.0
    x[7, 5] = float("nan")
    codes, scales = kv_int8.quantize_rows(x, 32)  # [50, 64], [50, 2]: a scale per 32 values
    assert scales.shape == (50, 2)
    ok = [i for i in range(50) if i not in (3, 7)]
    step = scales[ok].repeat_interleave(32, dim=1)  # [48, 64]
    back = codes[ok].float() * step
    assert (back - x[ok]).abs().le(step / 2 + x[ok].abs() * 1e-6).all()  # (float rounding)
    assert codes[ok].view(48, 2, 32).abs().amax(-1).eq(127).all()  # each group's largest: 127
    assert scales[3].eq(0).all() and codes[3].eq(0).all()
    assert scales[7, 0].isnan() and codes[7, :32].eq(0).all()  # its other group as any
    assert torch.equal(codes[7, 32:], kv_int8.quantize_rows(x[7:8, 32:], 32)[0][0])
    # keys: a scale per 8 values, each group's largest 127, the same half step
    key_codes, key_scales = kv_int8.quantize_rows(x[ok], 8)
    assert key_scales.shape == (48, 8) and key_codes.view(48, 8, 8).abs().amax(-1).eq(127).all()
    step = key_scales.repeat_interleave(8, dim=1)
    assert (key_codes.float() * step - x[ok]).abs().le(step / 2 + x[ok].abs() * 1e-6).all()
    assert [kv_int8.row_bytes(d, False) for d in (64, 128, 16, 24)] == [72, 144, 20, 36]
    assert [kv_int8.row_bytes(d, True) for d in (64, 128, 16, 24)] == [96, 192, 24, 36]


def int8_caches(float_caches, heads) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache, _ = float_caches
    num_kv_heads, num_blocks, block_size, d = k_cache.shape
    shape = (num_kv_heads, num_blocks, block_size)
    return tuple(
        torch.zeros(*shape, kv_int8.row_bytes(d, is_key), dtype=torch.int8)
        for is_key in (True, False)
    )


def stored_int8(heads, block_size: int, lens: list[int]):
    """requests_in_cache's tokens stored again by rope_store into int8 caches, and the same
    rows stored by the reference. Returns (qkv rotated, int8 caches, reference caches, rest)."""
    num_heads, num_kv_heads, d = heads
    qkv, caches, tables, row_tables, seq_lens = requests_in_cache(heads, block_size, lens)
    slots = []
    for i, n in enumerate(lens):
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(n)]
    slots = torch.tensor(slots)
    # rope_store rotates q and k in place: hand it the rotated rows with an identity rotation
    total = qkv.shape[0]
    ones, zeros = torch.ones(total, d), torch.zeros(total, d)
    int8 = int8_caches(caches, heads)
    torch.ops.tandem_cpu.rope_store(
        qkv.clone(), ones, zeros, *int8, slots, num_heads, num_kv_heads
    )  # fmt: skip
    q_size, kv_size = num_heads * d, num_kv_heads * d
    k = qkv[:, q_size : q_size + kv_size].reshape(total, num_kv_heads, d)
    v = qkv[:, q_size + kv_size :].reshape(total, num_kv_heads, d)
    reference = int8_caches(caches, heads)
    kv_int8.store(*reference, k, v, slots)
    return qkv, int8, reference, tables, row_tables, seq_lens


@pytest.mark.parametrize("block_size", [4, 12, 16])
@pytest.mark.parametrize("heads", [(3, 1, 8), (6, 2, 64), (4, 2, 128), (4, 4, 24)])
@pytest.mark.parametrize("window", [0, 7])
def test_int8_attend_equals_attention_over_the_dequantized_rows(block_size, heads, window):
    lens = [1, 19, 45]
    qkv, int8, reference, tables, row_tables, seq_lens = stored_int8(heads, block_size, lens)
    assert torch.equal(int8[0], reference[0]) and torch.equal(int8[1], reference[1])
    held = held_int8(qkv, int8, tables, heads, lens)
    assert_attends_as_stored(qkv, held, int8, tables, row_tables, seq_lens, heads, lens, window)


def held_int8(qkv, int8, tables, heads, lens):
    """qkv with its K and V rows as the int8 caches hold them (dequantized): the oracle's rows."""
    num_heads, num_kv_heads, d = heads
    q_size, kv_size = num_heads * d, num_kv_heads * d
    block_size = int8[0].shape[2]
    k_rows, v_rows = kv_int8.dequantize(int8[0], d, True), kv_int8.dequantize(int8[1], d, False)
    held = qkv.clone()
    flat_slots = []
    for i, n in enumerate(lens):
        flat_slots += [(int(tables[i, p // block_size]), p % block_size) for p in range(n)]
    blocks, offsets = (torch.tensor(c) for c in zip(*flat_slots, strict=True))
    held[:, q_size : q_size + kv_size] = k_rows[:, blocks, offsets].transpose(0, 1).flatten(1)
    held[:, q_size + kv_size :] = v_rows[:, blocks, offsets].transpose(0, 1).flatten(1)
    return held


def assert_attends_as_stored(qkv, held, caches, tables, row_tables, seq_lens, heads, lens, window):
    """attend over a cache whose rows were rounded as stored equals softmax attention over
    `held` (qkv with its K and V rows as the cache holds them), not over qkv's own rows (the
    broken variant), and any subset of rows gives those rows' bits alone."""
    scale = heads[2] ** -0.5
    got = attend(qkv, caches, tables, row_tables, seq_lens, heads, scale, window)
    want = reference_attention(held, heads, lens, scale, window).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = reference_attention(qkv, heads, lens, scale, window).float()
    assert not torch.allclose(got, exact, rtol=1e-5, atol=1e-5)
    for rows in ([0], [30], [64, 3, 40], list(range(20, 64, 5))):
        part = attend(
            qkv[rows], caches, tables, row_tables[rows], seq_lens[rows], heads, scale, window
        )
        assert torch.equal(part, got[rows]), rows


@pytest.mark.parametrize("which", ["short", "swapped", "k-as-v"])
def test_int8_caches_of_the_wrong_shape_are_refused(which):
    heads = (2, 1, 64)  # K rows 96 bytes (a scale per 8), V rows 72 (a scale per 32)
    qkv, caches, tables, row_tables, seq_lens = requests_in_cache(heads, 4, [6])
    k, v = int8_caches(caches, heads)
    wrong = {"short": (k[..., :-1], v[..., :-1]), "swapped": (v, k), "k-as-v": (v.clone(), v)}
    attend(qkv, (k, v), tables, row_tables, seq_lens, heads, 1.0, 0)  # (the right ones pass)
    with pytest.raises(RuntimeError, match="int8 caches must be"):
        attend(qkv, wrong[which], tables, row_tables, seq_lens, heads, 1.0, 0)


@pytest.mark.parametrize("block_size", [4, 12, 16])
@pytest.mark.parametrize("heads", [(3, 1, 8), (14, 2, 64), (4, 2, 128), (4, 4, 24)])
@pytest.mark.parametrize("window", [0, 7])
def test_bfloat16_attend_equals_attention_over_the_rounded_rows(block_size, heads, window):
    """A bfloat16 cache beside float32 activations: rope_store rounds each value to nearest even
    (torch's .to(torch.bfloat16)), attend widens them exactly: softmax attention over the
    rounded rows, each row's bits alone."""
    num_heads, num_kv_heads, d = heads
    lens = [1, 19, 45]
    qkv, caches, tables, row_tables, seq_lens = requests_in_cache(heads, block_size, lens)
    total = qkv.shape[0]
    slots = []
    for i, n in enumerate(lens):
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(n)]
    ones, zeros = torch.ones(total, d), torch.zeros(total, d)  # qkv is rotated already
    bf16 = tuple(torch.zeros_like(c, dtype=torch.bfloat16) for c in caches)
    torch.ops.tandem_cpu.rope_store(
        qkv.clone(), ones, zeros, *bf16, torch.tensor(slots), num_heads, num_kv_heads
    )  # fmt: skip
    assert all(torch.equal(b, c.to(torch.bfloat16)) for b, c in zip(bf16, caches, strict=True))
    q_size = num_heads * d
    held = qkv.clone()
    held[:, q_size:] = held[:, q_size:].to(torch.bfloat16).float()
    assert_attends_as_stored(qkv, held, bf16, tables, row_tables, seq_lens, heads, lens, window)
    scale = heads[2] ** -0.5
    with pytest.raises(RuntimeError, match="both alike"):  # K and V in one type
        attend(qkv, (bf16[0], caches[1]), tables, row_tables, seq_lens, heads, scale, window)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("window", [0, 700])
def test_a_requests_rows_share_the_cache_reads_and_keep_each_rows_bits(kv_dtype, window):
    """16 verification rows of one request at 1,185-1,200 tokens of context, past several of
    attend's key tiles (kernels/cpu/attend_rows.h: the rows of a request score each tile in
    turn, each row's value sums carried from tile to tile): softmax attention over the rows as
    stored, the bits of each row attended alone, whatever the block size (12: 8-lane loads, a
    row's heads per load and tiles of 60 keys; 16: on AVX-512, attend_wide.h's 16 lanes with up
    to 8 (row, head) pairs of several rows per load and tiles of 64, so equal bits also say that
    neither the tiling nor the sharing cuts a chain). A window of 700 starts each row's keys
    inside a tile."""
    heads, lens, rows = (9, 3, 64), [1200], list(range(1184, 1200))
    scale = heads[2] ** -0.5
    got = {}
    for block_size in (12, 16):
        if kv_dtype == torch.int8:
            qkv, caches, _, tables, row_tables, seq_lens = stored_int8(heads, block_size, lens)
            held = held_int8(qkv, caches, tables, heads, lens)
        else:
            qkv, caches, tables, row_tables, seq_lens = requests_in_cache(heads, block_size, lens)
            caches = tuple(c.to(kv_dtype) for c in caches)
            held = qkv.clone()
            held[:, heads[0] * heads[2] :] = held[:, heads[0] * heads[2] :].to(kv_dtype).float()
        args = (caches, tables)
        got[block_size] = attend(
            qkv[rows], *args, row_tables[rows], seq_lens[rows], heads, scale, window
        )
        want = reference_attention(held, heads, lens, scale, window)[rows].float()
        torch.testing.assert_close(got[block_size], want, rtol=1e-5, atol=1e-5)
        for i, row in enumerate(rows):
            alone = attend(
                qkv[[row]], *args, row_tables[[row]], seq_lens[[row]], heads, scale, window
            )
            assert torch.equal(alone, got[block_size][[i]]), row
    assert torch.equal(got[12], got[16])
