"""Weight-only quantized weights in one layout: torch's int4 CPU kernel's.

Every quantized weight is 4-bit codes c in [0, 16) in groups of GROUP = 32 along the input
dimension, each group with a scale s and a zero z: w = (c - 8) s + z, the layout of
`torch.ops.aten._weight_int4pack_mm_for_cpu`. 4-bit GGUF blocks (Q4_0, Q4_1, Q4_K) are this
layout already (w = s q + z0 per 32 values, so z = z0 + 8 s). Wider codes q in [0, 256) split
into two halves, q = 16 hi + lo: the [N, 2K] matrix [W_hi | W_lo] with W_hi = 16 s hi and
W_lo = s lo + z0 satisfies [x | x] @ [W_hi | W_lo]^T = x @ W^T, so one kernel call over the
input written twice serves 5- and 8-bit codes too (Q5_0, Q5_K, Q8_0 exactly).

The kernel takes bf16 activations and bf16 scales and zeros, sums in float32 and returns bf16:
that rounding is the whole numerical cost over the codes themselves (tests/test_quantized.py
states the quality rule). Without the kernel (other CPUs' torch builds, CUDA) a layer holds its
weight dequantized in the model's dtype: the same values, no speed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP = 32  # values per scale along the input dimension


@dataclass
class QuantizedWeight:
    """w[n, k] = sum over halves h of (codes[n, h K + k] - 8) scales[n, g] + zeros[n, g], g the
    group of column h K + k. One half holds 4-bit codes, two hold hi and lo nibbles."""

    codes: torch.Tensor  # [N, K * num_halves] uint8 in [0, 16)
    scales: torch.Tensor  # [N, K * num_halves / GROUP] float32
    zeros: torch.Tensor  # [N, K * num_halves / GROUP] float32
    num_halves: int

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] // self.num_halves

    @classmethod
    def from_codes(
        cls,
        q: torch.Tensor,  # [N, K] integer codes in [0, 2^bits)
        scale: torch.Tensor,  # [N, K / GROUP]: w = scale q + offset per group
        offset: torch.Tensor,  # [N, K / GROUP]
        bits: int,
    ) -> QuantizedWeight:
        q = q.to(torch.uint8)
        scale, offset = scale.float(), offset.float()
        if bits <= 4:  # (q - 8) s + (z0 + 8 s) = s q + z0
            return cls(q, scale, offset + 8 * scale, 1)
        assert bits <= 8, bits
        # hi half: (hi - 8) 16s + 128s = 16 s hi; lo half: (lo - 8) s + (8 s + z0) = s lo + z0
        codes = torch.cat([q >> 4, q & 15], dim=1)
        scales = torch.cat([16 * scale, scale], dim=1)
        zeros = torch.cat([128 * scale, 8 * scale + offset], dim=1)
        return cls(codes, scales, zeros, 2)

    @classmethod
    def quantize(cls, w: torch.Tensor, bits: int) -> QuantizedWeight:
        """Round-to-nearest over each group's [min, max] (as GGUF's Q4_1): w [N, K] float."""
        n, k = w.shape
        if k % GROUP:
            raise ValueError(f"in_features must be a multiple of {GROUP} to quantize, got {k}")
        groups = w.detach().float().reshape(n, k // GROUP, GROUP)
        low, high = groups.amin(-1), groups.amax(-1)  # [N, G]
        scale = (high - low) / (2**bits - 1)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 2**bits - 1)
        return cls.from_codes(q.reshape(n, k), scale, low, bits)

    def widened(self) -> QuantizedWeight:
        """The same weight as two halves (a zero hi half), to share a matrix with 8-bit rows."""
        if self.num_halves == 2:
            return self
        hi = torch.full_like(self.codes, 8)  # (8 - 8) s + 0 = 0
        return QuantizedWeight(
            torch.cat([hi, self.codes], 1),
            torch.cat([self.scales, self.scales], 1),
            torch.cat([torch.zeros_like(self.zeros), self.zeros], 1),
            2,
        )

    @staticmethod
    def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack output rows (fused q/k/v, gate/up); mixed widths widen to two halves."""
        if len({p.num_halves for p in parts}) > 1:
            parts = [p.widened() for p in parts]
        return QuantizedWeight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.zeros for p in parts]),
            parts[0].num_halves,
        )

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight(
            self.codes[index], self.scales[index], self.zeros[index], self.num_halves
        )

    def kernel_params(self) -> QuantizedWeight:
        """Scales and zeros rounded to bf16, as the kernel reads them."""
        return QuantizedWeight(
            self.codes,
            self.scales.bfloat16().float(),
            self.zeros.bfloat16().float(),
            self.num_halves,
        )

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        n = self.out_features
        codes = self.codes.reshape(n, -1, GROUP).float() - 8
        w = (codes * self.scales[..., None] + self.zeros[..., None]).reshape(n, -1)
        return w.reshape(n, self.num_halves, -1).sum(1)


@functools.cache
def int4_kernel_available() -> bool:
    """torch's int4 CPU kernel exists and runs here (checked once on a tiny matrix)."""
    aten = torch.ops.aten
    if not hasattr(aten, "_weight_int4pack_mm_for_cpu"):
        return False
    try:
        codes = torch.zeros(16, GROUP, dtype=torch.int32)
        packed = aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        params = torch.zeros(1, 16, 2, dtype=torch.bfloat16)
        aten._weight_int4pack_mm_for_cpu(torch.ones(1, GROUP).bfloat16(), packed, GROUP, params)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def reference_matmul(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """In plain torch, what the kernel computes: bf16 inputs and parameters, float32 sums,
    a bf16 result. The oracle for the kernel's tests."""
    w = weight.kernel_params().dequantize()
    return (x.bfloat16().float() @ w.t()).bfloat16()


class Int4Linear:
    """y = x W^T + b over a QuantizedWeight: the int4 kernel on CPU, else dense in `dtype`."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.num_halves = weight.num_halves
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        self.dense: torch.Tensor | None = None  # [N, K] where the kernel does not run
        self.packed: torch.Tensor | None = None  # the kernel's [N, K * halves / 2] uint8
        self.params: torch.Tensor | None = None  # [K * halves / GROUP, N, 2] bf16 scale, zero
        on_cpu = torch.device(device).type == "cpu"
        if on_cpu and weight.out_features % 16 == 0 and int4_kernel_available():
            self.packed = _pack(weight.codes)
            params = torch.stack([weight.scales, weight.zeros], dim=-1)  # [N, G, 2]
            self.params = params.transpose(0, 1).contiguous().bfloat16()
        else:
            self.dense = weight.kernel_params().dequantize().to(device=device, dtype=dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, N] in x's dtype
        if self.dense is not None:
            return F.linear(x, self.dense, self.bias)
        xb = x.bfloat16()
        if self.num_halves == 2:
            xb = torch.cat([xb, xb], dim=-1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP, self.params)
        y = y.to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)


def _pack(codes: torch.Tensor, rows_per_chunk: int = 4096) -> torch.Tensor:
    """The kernel's packed layout, built a slice of rows at a time (it wants int32 codes: four
    bytes per code for the whole matrix at once would be the largest allocation of a load).
    Rows pack independently: slices of a multiple of 16 rows concatenate to the whole."""
    chunks = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes[i : i + rows_per_chunk].int(), 1)
        for i in range(0, codes.shape[0], rows_per_chunk)
    ]
    return torch.cat(chunks) if len(chunks) > 1 else chunks[0]


class QuantizedEmbedding:
    """Rows of a QuantizedWeight dequantized on lookup: two codes per byte at rest."""

    def __init__(self, weight: QuantizedWeight, device: torch.device | str, dtype: torch.dtype):
        codes = weight.codes
        self.packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(device)  # [V, K * halves / 2]
        self.scales, self.zeros = weight.scales.to(device), weight.zeros.to(device)
        self.num_halves, self.dtype = weight.num_halves, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, K]
        packed = self.packed[ids]
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
        rows = QuantizedWeight(codes, self.scales[ids], self.zeros[ids], self.num_halves)
        return rows.dequantize().to(self.dtype)
