"""Each row's argmax and NaN flag in one read (kernels/cpu/argmax.cpp, engine.sampler.argmax_rows):
torch.argmax's index (the first maximal one) and isnan().any()'s flag on every row."""

from __future__ import annotations

import pytest
import torch

from engine.models.quantized import tandem_kernel_available
from engine.sampler import argmax_rows

pytestmark = pytest.mark.skipif(not tandem_kernel_available(), reason="no C++ kernel")


@pytest.mark.parametrize("vocab", [1, 7, 8, 49152, 262147])  # lanes of 8 and a tail
def test_the_index_is_torchs_first_maximum_and_nans_are_flagged(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = torch.randn(9, vocab + 5, generator=g)[:, :vocab]  # rows of a padded vocabulary
    rows[1] = torch.randint(-3, 3, (vocab,), generator=g).float()  # ties: the first one wins
    rows[2] = float("-inf")
    rows[3, -1] = 100.0  # the maximum in the tail
    rows[4] = -0.0
    rows[4, vocab // 2] = 0.0  # equal to -0.0: the first index, as torch
    rows[5, vocab // 3] = float("nan")
    rows[6, -1] = float("nan")
    rows[7, 0] = float("inf")
    index, is_nan = torch.ops.tandem_cpu.argmax_rows(rows)
    want_nan = rows.isnan().any(dim=-1)
    assert torch.equal(is_nan, want_nan) and is_nan[5] and is_nan[6]
    assert torch.equal(index[~want_nan], rows.argmax(dim=-1)[~want_nan])
    assert argmax_rows(rows)[0].tolist() == index.tolist()  # what the engine calls


def test_float16_or_rows_of_strided_columns_take_torchs_path():
    rows = torch.randn(3, 100).half()
    index, is_nan = argmax_rows(rows)
    assert torch.equal(index, rows.argmax(dim=-1)) and not is_nan.any()
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.tandem_cpu.argmax_rows(torch.randn(100, 3).t())
