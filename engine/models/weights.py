"""How a projection's weight is stored and multiplied: one format object per Linear, chosen at
load (engine.models.layers.Linear holds it). Each maps x [M, in] to [M, out], bias included.

- `Dense`: [out, in] in the model's dtype, F.linear: the exact reference, and CUDA's.
- `Packed`: oneDNN's blocked copy of a float32 weight (CPU). MKL's sgemm is slow at the few rows
  of decode, where oneDNN's packed GEMM is well ahead (bench.choices; bench/RESULTS.md
  "Measurements behind the core's choices"); at one row and at a few hundred they are even.
- `DynamicInt8`: per-channel int8 weights, activations quantized per call (draft models on
  CPU, engine.models.quant).
- engine.models.quantized.QuantizedLinear: integer codes with a scale and offset per 32 inputs
  (a GGUF's blocks, or int4 / int8 from a dense checkpoint).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.quant import linear_int8, pack_int8


def onednn_linear_available() -> bool:
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def padded_rows(num_rows: int) -> int:
    """The row count a packed GEMM runs at: exact up to 32 rows, above that rounded up to an
    eighth of the power of two below (at most 12.5% padding; 8 sizes per doubling)."""
    if num_rows <= 32:
        return num_rows
    step = 1 << (num_rows.bit_length() - 4)
    return -(-num_rows // step) * step


def packed_linear(
    x: torch.Tensor,  # [M, in]
    packed: torch.Tensor,  # oneDNN's blocked [out, in]
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [M, out]
    """oneDNN's GEMM over x's rows padded to padded_rows(M).

    oneDNN builds and keeps state for every input shape it sees (primitives, JIT code,
    buffers), so a server whose steps keep bringing new row counts keeps growing: over
    M = 1..1024 through SmolLM2's four projections the live heap grew by ~113 KB per (shape,
    projection), 83 -> 546 MB, and glibc held 1.86 GB more freed around it (RSS 254 -> 2591
    MB). Padded to these sizes RSS stopped at 440 MB and stayed there on a second pass.
    """
    num_rows = x.shape[0]
    padded = padded_rows(num_rows)
    if padded != num_rows:
        x = F.pad(x, (0, 0, 0, padded - num_rows))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:num_rows]


class Dense(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def packed(self) -> Packed:
        return Packed(self.weight.detach(), self.bias)

    def dynamic_int8(self) -> DynamicInt8:
        return DynamicInt8(self.weight.detach(), self.bias)


class Packed(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)  # opaque
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.bias)


class DynamicInt8(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = pack_int8(weight, None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_int8(x, self.weight)


class DenseHead(Dense):
    """An LM head's dense weight (the embedding's own Parameter when tied), with oneDNN's
    packed copy beside it once packed: the copy from two rows on; at one row MKL's gemv, which
    is faster there depends on the head's shape and the CPU (bench.choices measures both)."""

    def __init__(self, weight: nn.Parameter | torch.Tensor):
        super().__init__(weight, None)
        if isinstance(weight, nn.Parameter):  # shared with the embedding (tied)
            self.weight = weight
        self.copy: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy is not None and x.shape[0] > 1:
            return packed_linear(x, self.copy, None)
        return F.linear(x, self.weight)

    def packed(self) -> DenseHead:
        self.copy = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        return self
