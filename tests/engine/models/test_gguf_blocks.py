"""GGUF blocks in their own formats: decoded exactly (engine/models/gguf_blocks.py), kept in the
file's form through the loader's fusions and slices, and held by the tandem kernel at their own
width with the reference's bits (engine/models/quantized.py, kernels/cpu/quant_matmul.cpp)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from quant_blocks import HEADERS, random_blocks

from engine.models.gguf_blocks import EXACT_TYPES, decode
from engine.models.quantized import (
    GROUP,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedRows,
    QuantizedWeight,
    reference_matmul,
    tandem_kernel_available,
)

needs_tandem = pytest.mark.skipif(not tandem_kernel_available(), reason="no C++ kernel")
BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q4_K: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q5_K: 5, T.Q6_K: 6, T.Q8_0: 8}


@pytest.mark.parametrize("qtype", sorted(HEADERS, key=int), ids=lambda t: t.name)
def test_gguf_blocks_decode_to_gguf_dequantize(qtype):
    rows, cols = 16, 512
    raw = random_blocks(qtype, rows, cols)
    want = torch.from_numpy(dequantize(raw, qtype).reshape(rows, cols).astype(np.float32))
    weight = decode(raw, qtype, cols)
    got = weight.dequantize()
    assert (weight.codes.int() < 2**weight.bits).all()
    if qtype in EXACT_TYPES:  # the block's own codes, scales and offsets
        assert weight.bits == BITS[qtype]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        if qtype == T.Q6_K:  # s (q - 32): every product exact, gguf's own values bit for bit
            assert torch.equal(got, want) and weight.group == 16
        # K-quants also keep the file's own float16 d (and dmin) and sub-scales (and mins)
        assert (weight.blocks is not None) == qtype.name.endswith("_K")
        if weight.blocks is not None:
            assert weight.blocks.d.dtype == torch.float16 and weight.blocks.d.shape == (16, 2)
            if qtype == T.Q6_K:  # 16 signed scales per 256
                assert weight.blocks.scales.dtype == torch.int8 and weight.blocks.mins is None
            else:  # 8 six-bit scales and mins per 256
                assert weight.blocks.scales.dtype == torch.uint8 and weight.blocks.scales.max() < 64
            scales, offsets = weight.blocks.expand()
            assert torch.equal(scales, weight.scales) and torch.equal(offsets, weight.offsets)
    else:  # requantized to 8 bits: within half a step of each group's range / 255
        groups = want.reshape(rows, -1, GROUP)
        step = (groups.amax(-1) - groups.amin(-1)) / 255
        bound = step.repeat_interleave(GROUP, 1) / 2 * 1.001 + 1e-6  # fp32 rounding
        assert ((got - want).abs() <= bound).all()
        assert (got - want).abs().max() > 0  # really requantized


def test_super_blocks_survive_stacking_slicing_and_row_order_only_where_whole():
    """K-quant scales stay in the file's form through the loader's fusions, tensor-parallel
    slices and row permutations, and fall back to float32 tables where they cannot."""
    k4 = decode(random_blocks(T.Q4_K, 16, 512, seed=1), T.Q4_K, 512)
    k4b = decode(random_blocks(T.Q4_K, 32, 512, seed=2), T.Q4_K, 512)
    q8 = decode(random_blocks(T.Q8_0, 16, 512, seed=3), T.Q8_0, 512)
    dense = [w.dequantize() for w in (k4, k4b, q8)]
    fused = QuantizedWeight.cat_rows([k4, k4b])
    assert fused.bits == 4 and fused.blocks is not None
    assert torch.equal(fused.dequantize(), torch.cat(dense[:2]))
    k5 = decode(random_blocks(T.Q5_K, 32, 512, seed=2), T.Q5_K, 512)
    wider = QuantizedWeight.cat_rows([k4, k5]).merged()  # one matrix: 5-bit, blocks kept
    assert wider.bits == 5 and wider.blocks is not None
    assert torch.equal(wider.dequantize(), torch.cat([dense[0], k5.dequantize()]))
    mixed = QuantizedWeight.cat_rows([k4, q8])  # segments, each in its own form
    assert isinstance(mixed, QuantizedRows) and [p.bits for p in mixed.parts] == [4, 8]
    assert mixed.parts[0].blocks is not None
    assert torch.equal(mixed.dequantize(), torch.cat([dense[0], dense[2]]))
    merged = mixed.merged()  # one matrix (torch's int4 kernel's form): widened, exact
    assert merged.bits == 8 and merged.blocks is None
    assert torch.equal(merged.dequantize(), torch.cat([dense[0], dense[2]]))
    half = fused.columns(256, 512)
    assert half.blocks is not None and half.blocks.d.shape == (48, 1)
    assert torch.equal(half.dequantize(), torch.cat(dense[:2])[:, 256:])
    assert torch.equal(torch.stack(half.blocks.expand()), torch.stack([half.scales, half.offsets]))
    assert fused.columns(0, 128).blocks is None
    order = torch.randperm(48, generator=torch.Generator().manual_seed(0))
    permuted = fused.rows(order)
    assert torch.equal(
        torch.stack(permuted.blocks.expand()), torch.stack([permuted.scales, permuted.offsets])
    )
    # Q6_K (a scale per 16): whole super-blocks keep its form; anything else is requantized
    # to a scale and offset per 32 (8 bits), as stacking it with another type is
    q6 = decode(random_blocks(T.Q6_K, 16, 512, seed=4), T.Q6_K, 512)
    assert q6.columns(256, 512).group == 16 and q6.columns(256, 512).blocks is not None
    assert torch.equal(q6.columns(256, 512).dequantize(), q6.dequantize()[:, 256:])
    split = q6.columns(0, 128)
    assert split.group == GROUP and split.bits == 8 and split.blocks is None
    want = q6.dequantize()[:, :128].reshape(16, -1, GROUP)
    step = (want.amax(-1) - want.amin(-1))[..., None] / 255  # half a step, as requantizing
    assert ((split.dequantize().reshape(16, -1, GROUP) - want).abs() <= step / 2 * 1.001).all()
    qkv = QuantizedWeight.cat_rows([k4, k4, q6])  # q, k in Q4_K, v in Q6_K: as the file has
    assert [(p.bits, p.group, p.out_features) for p in qkv.parts] == [(4, 32, 32), (6, 16, 16)]
    assert torch.equal(qkv.dequantize(), torch.cat([dense[0], dense[0], q6.dequantize()]))
    assert qkv.merged().bits == 8 and qkv.merged().group == GROUP  # Q6_K requantized there
    # a tensor-parallel share of each segment keeps the segments' forms
    share = qkv.rows(torch.tensor([0, 1, 16, 17, 32, 33]))
    assert [(p.bits, p.group, p.out_features) for p in share.parts] == [(4, 32, 4), (6, 16, 2)]
    assert torch.equal(share.dequantize(), qkv.dequantize()[[0, 1, 16, 17, 32, 33]])
    assert torch.equal(qkv.columns(256, 512).dequantize(), qkv.dequantize()[:, 256:])


FILE_FORMATS = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


@needs_tandem
@pytest.mark.parametrize("qtype", FILE_FORMATS, ids=lambda t: t.name)
def test_file_formats_are_held_in_their_own_bits_with_the_references_results(qtype):
    """Each GGUF type in the tandem kernel's memory at its own width: 4-bit codes two to a
    byte, 5- and 6-bit as those plus a plane per higher bit, 8-bit one to a byte; K-quant
    scales as the file's float16 d (and dmin) per 256 inputs with their sub-scales (and mins)
    as bytes; Q4_0, Q5_0 and Q8_0 hold their float16 d alone (m = -2^(bits - 1) d, the kernel
    forms it). Results are the reference's bits, rows and token embeddings alike; for the
    affine types also the bits of the same weight held the wide way (8-bit codes, float32
    scales and offsets)."""
    rows, cols = 40, 512  # 40: a partial tile
    weight = decode(random_blocks(qtype, rows, cols, seed=int(qtype)), qtype, cols)
    layer = QuantizedLinear(weight, None, backend="tandem")
    groups = cols // GROUP
    assert layer.codes.shape == (3, groups, {4: 256, 5: 320, 6: 384, 8: 512}[BITS[qtype]])
    if qtype.name.endswith("_K"):  # per tile and 256 inputs: 16 float16, then sub-scales
        assert layer.scales.dtype == layer.offsets.dtype == torch.uint8
        assert layer.scales.shape == (3, cols // 256, 288 if qtype == T.Q6_K else 160)
    else:  # the file's float16; a centered type's offsets (-2^(bits - 1) d) formed, not held
        assert layer.scales.dtype == torch.float16 and layer.scales.shape == (3, groups, 16)
        assert (layer.offsets is layer.scales) == (qtype in (T.Q4_0, T.Q5_0, T.Q8_0))
    wide = None
    if weight.group == GROUP:
        wide_weight = QuantizedWeight(weight.codes, weight.scales, weight.offsets, 8)
        wide = QuantizedLinear(wide_weight, None, backend="tandem")
        assert wide.scales.dtype != torch.uint8 and wide.codes.shape[-1] == 512
    g = torch.Generator().manual_seed(5)
    for num_rows in (1, 5, 17):
        x = torch.randn(num_rows, cols, generator=g)
        got = layer(x)
        assert torch.equal(got, reference_matmul(x, weight, "tandem")), num_rows
        assert wide is None or torch.equal(got, wide(x)), num_rows
        # and near the float weights (int8 activations: about 1% of the output's scale)
        exact = x @ weight.dequantize().t()
        assert (got - exact).abs().max() < 0.03 * exact.abs().max()
    ids = torch.tensor([0, 7, 15, 16, 39])
    rows_out = QuantizedEmbedding(weight, "cpu", torch.float32)(ids)
    assert torch.equal(rows_out, weight.dequantize()[ids])


@needs_tandem
def test_q6_k_reference_is_its_own_order_and_a_wrong_center_fails():
    """Q6_K's kernel numerics (each half group: fma(D - 32 S, s dx)) pinned by the reference;
    codes read with the wrong center (q - 31: one step off in every weight) do not match."""
    weight = decode(random_blocks(T.Q6_K, 32, 768, seed=9), T.Q6_K, 768)
    layer = QuantizedLinear(weight, None, backend="tandem")
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(9))
    got = layer(x)
    assert torch.equal(got, reference_matmul(x, weight, "tandem"))
    off = QuantizedWeight(weight.codes + 1, weight.scales, weight.offsets, 6, weight.blocks)
    assert not torch.equal(got, reference_matmul(x, off, "tandem"))
