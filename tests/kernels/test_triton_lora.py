"""Triton SGMV LoRA kernels against their pure-torch references: under TRITON_INTERPRET=1 on CPU
(fp32, the default run), and on CUDA with bf16 when a GPU is present (`gpu` marker)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton_lora import lora_expand, lora_shrink  # TRITON_INTERPRET: conftest

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def segmented(seg_lens, seg_slots, num_rows, gen):
    """Rows with an adapter, scattered over num_rows and grouped by slot; the others unlisted."""
    listed = torch.randperm(num_rows, generator=gen)[: sum(seg_lens)]
    starts = [0]
    for n in seg_lens:
        starts.append(starts[-1] + n)
    return listed, starts, list(seg_slots)


def stacks(num_slots, size_in, rank, size_out, gen, dtype):
    a = torch.randn(num_slots + 1, size_in, rank, generator=gen) * 0.2
    b = torch.randn(num_slots + 1, rank, size_out, generator=gen) * 0.2
    a[0], b[0] = 0, 0  # slot 0: no adapter
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


def run_both(seg_lens, seg_slots, *, num_rows, size_in, rank, size_out, y_offset, width, dtype):
    gen = torch.Generator().manual_seed(sum(seg_lens) + rank)
    rows, starts, slots = segmented(seg_lens, seg_slots, num_rows, gen)
    a, b = stacks(max(seg_slots, default=1), size_in, rank, size_out, gen, dtype)
    x = torch.randn(num_rows, size_in, generator=gen).to(DEVICE, dtype)
    y = torch.randn(num_rows, width, generator=gen).to(DEVICE, dtype)
    want_y = y.clone()
    d_rows = rows.to(DEVICE, torch.int32)
    d_starts = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    d_slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    max_len = max(seg_lens, default=0)
    shrunk = lora_shrink(x, a, d_rows, d_starts, d_slots, max_len)
    lora_expand(shrunk, b, y, y_offset, d_rows, d_starts, d_slots, max_len)
    want = reference.lora_shrink(x, a, rows.to(DEVICE), starts, slots)
    # The expand is checked on the kernel's own shrunk rows: in bf16 the two shrinks differ by
    # an ulp here and there, which the expand would carry into y beyond its own error.
    reference.lora_expand(shrunk, b, want_y, y_offset, rows.to(DEVICE), starts, slots)
    return shrunk, want, y, want_y, rows


@pytest.mark.parametrize(
    ("seg_lens", "seg_slots"),
    [
        ([1], [1]),  # one decode row
        ([1, 1, 1, 1], [3, 1, 4, 2]),  # decodes of four adapters, slots out of order
        ([3, 17, 1, 40], [2, 1, 4, 3]),  # verify-sized, prefill chunks over tile edges
        ([16, 32], [1, 2]),  # exactly whole tiles
    ],
)
@pytest.mark.parametrize("rank", [4, 12, 16])  # 12: padded to the next power of two, masked
def test_shrink_expand_equal_reference(seg_lens, seg_slots, rank):
    """in/out widths off the tile sizes, a column offset inside y, unlisted rows untouched."""
    shrunk, want, y, want_y, _ = run_both(
        seg_lens,
        seg_slots,
        num_rows=sum(seg_lens) + 7,
        size_in=72,
        rank=rank,
        size_out=100,
        y_offset=24,
        width=150,
        dtype=torch.float32,
    )
    torch.testing.assert_close(shrunk, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    assert (shrunk.abs().sum(1) > 0).all()  # every listed row met a non-zero adapter


def test_expand_touches_only_listed_rows_and_its_columns():
    gen = torch.Generator().manual_seed(5)
    a, b = stacks(2, 32, 8, 40, gen, torch.float32)
    x = torch.randn(10, 32, generator=gen).to(DEVICE)
    y = torch.randn(10, 100, generator=gen).to(DEVICE)
    before = y.clone()
    rows = torch.tensor([7, 2, 5], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([2, 1], dtype=torch.int32, device=DEVICE)
    lora_expand(lora_shrink(x, a, rows, starts, slots, 2), b, y, 30, rows, starts, slots, 2)
    changed = (y != before).nonzero().tolist()
    assert {r for r, _ in changed} == {7, 2, 5}
    assert {c for _, c in changed} <= set(range(30, 70)) and len(changed) > 100


def test_empty_batch_is_a_no_op():
    gen = torch.Generator().manual_seed(0)
    a, b = stacks(1, 16, 4, 16, gen, torch.float32)
    x = torch.randn(3, 16).to(DEVICE)
    y = torch.zeros(3, 16).to(DEVICE)
    none = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    starts = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    shrunk = lora_shrink(x, a, none, starts, none, 0)
    assert shrunk.shape == (0, 4)
    lora_expand(shrunk, b, y, 0, none, starts, none, 0)
    assert not y.any()


def test_launchers_name_what_is_wrong():
    gen = torch.Generator().manual_seed(0)
    a, b = stacks(2, 16, 4, 8, gen, torch.float32)
    x = torch.randn(4, 16).to(DEVICE)
    rows = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be \[T, in\]"):
        lora_shrink(torch.randn(4, 15).to(DEVICE), a, rows, starts, slots, 2)
    with pytest.raises(ValueError, match="seg_slots"):
        lora_shrink(x, a, rows, starts, torch.tensor([1, 2], dtype=torch.int32), 2)
    if DEVICE == "cpu":  # values are checked only where that costs no device sync
        with pytest.raises(ValueError, match=r"seg_slots must be in \[1, 3\)"):
            lora_shrink(x, a, rows, starts, torch.tensor([0], dtype=torch.int32), 2)
    shrunk = lora_shrink(x, a, rows, starts, slots, 2)
    with pytest.raises(ValueError, match="columns"):
        lora_expand(shrunk, b, torch.zeros(4, 8).to(DEVICE), 1, rows, starts, slots, 2)
    with pytest.raises(ValueError, match="a row per listed row"):
        lora_expand(shrunk[:1], b, torch.zeros(4, 8).to(DEVICE), 0, rows, starts, slots, 2)


def test_lora_batch_kernels_equal_torch_path(tiny_llama, tmp_path):
    """KernelLoRABatch (the Triton path) adds what PackedLoRABatch (the torch path) adds, for a
    mixed step: two adapters' prefill segments, decodes of three adapters, and rows without an
    adapter."""
    from engine.models.loader import load_model
    from lora.batch import KernelLoRABatch, LoRASlots, PackedLoRABatch

    _, cfg, _ = load_model(tiny_llama)
    slots = LoRASlots(cfg, max_loras=3, max_rank=8)
    gen = torch.Generator().manual_seed(1)
    for (layer, proj), (size_in, size_out) in [
        ((0, p), slots.shapes[p]) for p in ("q_proj", "k_proj", "v_proj")
    ]:
        slots.a[(layer, proj)] = torch.randn(4, size_in, 8, generator=gen) * 0.2
        slots.b[(layer, proj)] = torch.randn(4, 8, size_out, generator=gen) * 0.2
    token_slots = [1] * 12 + [0] * 3 + [2] * 10 + [3, 0, 1, 2, 3]
    width = sum(slots.shapes[p][1] for p in ("q_proj", "k_proj", "v_proj"))
    x = torch.randn(len(token_slots), cfg.hidden_size, generator=gen)
    y = torch.randn(len(token_slots), width, generator=gen)
    outs = {}
    for backend, batch in (("torch", PackedLoRABatch), ("triton", KernelLoRABatch)):
        outs[backend] = y.clone()
        batch.build(slots, token_slots).apply(0, "qkv", x, outs[backend])
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-5, atol=1e-5)
    assert not torch.equal(outs["torch"], y)
    assert torch.equal(outs["triton"][12:15], y[12:15])  # no adapter: untouched


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_gpu_bf16_larger_shapes(rank):
    """1B-like widths, 8 adapters, 64 decode rows and two prefill segments, bf16."""
    seg_lens = [200, 1, 1, 3, 1, 130, 1, 1]
    shrunk, want, y, want_y, _ = run_both(
        seg_lens,
        list(range(1, 9)),
        num_rows=400,
        size_in=2048,
        rank=rank,
        size_out=2048 + 512,
        y_offset=512,
        width=4096,
        dtype=torch.bfloat16,
    )
    torch.testing.assert_close(shrunk, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y.float(), want_y.float(), rtol=2e-2, atol=5e-2)
