"""oneDNN packed projections: rows padded to a few sizes, results equal to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.layers import Linear, onednn_linear_available, padded_rows


def test_padded_rows_few_sizes_little_padding():
    sizes = [padded_rows(m) for m in range(1, 1025)]
    assert sizes[:32] == list(range(1, 33))  # decode batches run exactly
    for m, p in enumerate(sizes, start=1):
        assert m <= p <= m * 1.125
        assert padded_rows(p) == p  # a padded size pads to itself
    assert sizes == sorted(sizes)
    # 32 exact sizes, then 8 per doubling: oneDNN keeps state per shape, so this is bounded.
    assert len(set(sizes)) == 32 + 8 * 5
    assert len({padded_rows(m) for m in range(1, 8193)}) == 32 + 8 * 8


@pytest.mark.skipif(not onednn_linear_available(), reason="no oneDNN linear in this torch")
@pytest.mark.parametrize("num_rows", [1, 7, 33, 100, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_dense(num_rows, bias):
    g = torch.Generator().manual_seed(num_rows)
    linear = Linear(48, 80, bias)
    weight = torch.randn(80, 48, generator=g)
    b = torch.randn(80, generator=g) if bias else None
    linear.load(weight, b, "cpu", torch.float32)
    x = torch.randn(num_rows, 48, generator=g)
    expected = F.linear(x, weight, b)
    linear.pack()
    got = linear(x)
    assert got.shape == (num_rows, 80)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    # The padding rows are zeros and never leak into the returned rows.
    torch.testing.assert_close(linear(x[:1]), got[:1])
