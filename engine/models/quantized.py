"""Weight-only quantized weights and the layers that run them.

A quantized weight holds integer codes q in [0, 2^bits) with, per GROUP = 32 inputs of a row, a
scale d and an offset m: w = d q + m, the affine form GGUF's block types reduce to (Q4_0, Q4_1
and Q4_K in 4-bit codes; Q5_0, Q5_1 and Q5_K in 5-bit; Q8_0 in 8-bit; Q6_K in 6-bit codes with
a scale s per 16 inputs, w = s (q - 32); others requantized to 8 bits by
engine/models/gguf_blocks.py). d and m are float32 here, exact (every block's are float16, or
for K-quants a float16 times a small integer: `SuperBlocks`). The tandem kernel holds them as
the file does: float16, or a K-quant's float16 d (and dmin) per 256 inputs with its sub-scales
(and mins) as bytes, forming d x sub-scale in float32 as it reads them (the same bits as a
float32 table). Its codes: 4 bits two to a byte, 5 and 6 bits as that plus their higher bits
byte-sliced (8 or 4 codes' to a byte), 8 bits one to a byte.

`QuantizedLinear` runs y = x W^T + b with the first of these that runs here:
- "tandem": our C++ kernel (kernels/cpu/quant_matmul.cpp): activations quantized per 32 values
  to int8 (as llama.cpp does), exact integer dot products per group (AVX-512 VNNI, AVX-VNNI or
  AVX2), 4-, 5-, 6- and 8-bit codes natively, float32 in and out, and one order of float steps for
  every output element: a row's result is the same bits whatever rows share its call (decode,
  verification and prefill alike), on every instruction set.
- "int4pack": torch's `_weight_int4pack_mm_for_cpu` (bf16 activations, bf16 scales and zeros,
  4-bit codes; wider codes as two nibble halves over the input written twice, see `halves`;
  Q6_K requantized to 8 bits per 32, `affine`).
- "dense": the weight dequantized in the model's dtype (CUDA, or CPUs where neither runs).
`TANDEM_QUANT_KERNEL=tandem|int4pack|dense` forces one (tests run the same checks over each).
Each backend's exact arithmetic is written out in `reference_matmul`, the oracle of its tests;
the quality rule against the float32 weights is tests/engine/test_quantized.py's.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32  # values per scale along the input dimension
SUPER = 256  # values per K-quant super-block (its float16 d and dmin)
TILE = 16  # output rows the tandem kernel interleaves (see _pack_tandem)
BACKENDS = ("tandem", "int4pack", "dense")


@dataclass
class SuperBlocks:
    """K-quant scales and offsets as the file holds them. Q4_K, Q5_K: per SUPER = 256 inputs of
    a row a float16 d and dmin, per 32 a 6-bit scale sc and min mn (uint8): the group's scale
    is d sc and its offset (-dmin) mn. Q6_K: per 256 a float16 d, per 16 a signed 8-bit sc
    (int8, no mins): the scale s = d sc, and w = s (q - 32). Products exact in float32."""

    d: torch.Tensor  # [N, K / SUPER] float16
    scales: torch.Tensor  # [N, K / GROUP] uint8 in [0, 64); Q6_K: [N, K / 16] int8
    neg_dmin: torch.Tensor | None  # [N, K / SUPER] float16: -dmin, so the offset is a product
    mins: torch.Tensor | None  # [N, K / GROUP] uint8 in [0, 64)

    def expand(self) -> tuple[torch.Tensor, torch.Tensor]:  # scales, offsets [N, K / group]
        per = self.scales.shape[1] // self.d.shape[1]  # groups per super-block
        scales = self.d.float().repeat_interleave(per, 1) * self.scales.float()
        if self.mins is None:  # Q6_K: w = s (q - 32)
            return scales, -32 * scales
        return scales, self.neg_dmin.float().repeat_interleave(per, 1) * self.mins.float()

    def map(self, fn) -> SuperBlocks:  # the same function of every field's [N, ...]
        def apply(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return SuperBlocks(*(apply(t) for t in (self.d, self.scales, self.neg_dmin, self.mins)))

    @staticmethod
    def cat_rows(parts: list[SuperBlocks]) -> SuperBlocks:
        def cat(field: str) -> torch.Tensor | None:
            tensors = [getattr(b, field) for b in parts]
            return None if tensors[0] is None else torch.cat(tensors)

        return SuperBlocks(cat("d"), cat("scales"), cat("neg_dmin"), cat("mins"))

    def columns(self, start: int, end: int) -> SuperBlocks:  # inputs, multiples of SUPER
        per = self.scales.shape[1] // self.d.shape[1]
        a, b = start // SUPER, end // SUPER
        d, scales = self.d[:, a:b], self.scales[:, a * per : b * per]
        neg_dmin = None if self.mins is None else self.neg_dmin[:, a:b]
        mins = None if self.mins is None else self.mins[:, a * per : b * per]
        return SuperBlocks(d, scales, neg_dmin, mins).map(torch.Tensor.contiguous)


@dataclass
class QuantizedWeight:
    """w[n, k] = codes[n, k] scales[n, g] + offsets[n, g], g = k // group: group = GROUP, or 16
    for Q6_K, whose offsets are -32 scales (w = s (q - 32)) and which always has `blocks`.
    K-quants carry `blocks`, the same scales and offsets in the file's own form (what the
    tandem kernel holds)."""

    codes: torch.Tensor  # [N, K] uint8 in [0, 2^bits)
    scales: torch.Tensor  # [N, K / group] float32
    offsets: torch.Tensor  # [N, K / group] float32
    bits: int  # 4, 5, 6 or 8: the width the codes are stored at
    blocks: SuperBlocks | None = None  # equal to scales and offsets where set

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def group(self) -> int:  # inputs per scale
        return self.in_features // self.scales.shape[1]

    @classmethod
    def from_codes(
        cls,
        q: torch.Tensor,  # [N, K] integer codes in [0, 2^bits)
        scale: torch.Tensor,  # [N, K / GROUP]
        offset: torch.Tensor,  # [N, K / GROUP]
        bits: int,
    ) -> QuantizedWeight:
        if not 1 <= bits <= 8:
            raise ValueError(f"bits must be in [1, 8], got {bits}")
        width = 4 if bits <= 4 else bits if bits <= 6 else 8
        return cls(q.to(torch.uint8), scale.float(), offset.float(), width)

    @classmethod
    def from_super_blocks(cls, q: torch.Tensor, blocks: SuperBlocks, bits: int) -> QuantizedWeight:
        """K-quant codes q [N, K] with their file's scales (SuperBlocks)."""
        weight = cls.from_codes(q, *blocks.expand(), bits)
        weight.blocks = blocks
        return weight

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

    def widened(self, bits: int) -> QuantizedWeight:
        """The same weight in wider codes, to share a matrix with such rows."""
        return QuantizedWeight(self.codes, self.scales, self.offsets, bits, self.blocks)

    def columns(self, start: int, end: int) -> QuantizedWeight:
        """Inputs [start, end) of every row (whole groups: both multiples of GROUP); the file's
        super-blocks kept where whole ones are taken (Q6_K's requantized where not)."""
        if start % GROUP or end % GROUP:
            raise ValueError(f"columns {start}:{end} split a group of {GROUP} inputs")
        whole = self.blocks is not None and start % SUPER == 0 and end % SUPER == 0
        if self.group != GROUP and not whole:
            return self.affine().columns(start, end)
        groups = slice(start // self.group, end // self.group)
        blocks = self.blocks.columns(start, end) if whole else None
        return QuantizedWeight(
            self.codes[:, start:end].contiguous(),
            self.scales[:, groups].contiguous(),
            self.offsets[:, groups].contiguous(),
            self.bits,
            blocks,
        )

    @staticmethod
    def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight | QuantizedRows:
        """Stack output rows (fused q/k/v, gate/up). Parts of one form (width, inputs per
        scale, the file's super-blocks or not) become one weight; parts of several stay
        segments in their own forms (`QuantizedRows`: a Q6_K v beside Q4_K q and k)."""
        segments: list[list[QuantizedWeight]] = []
        for p in parts:
            if segments and _form(segments[-1][0]) == _form(p):
                segments[-1].append(p)
            else:
                segments.append([p])
        merged = [s[0] if len(s) == 1 else QuantizedWeight._stack(s) for s in segments]
        return merged[0] if len(merged) == 1 else QuantizedRows(merged)

    @staticmethod
    def _stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Parts' rows as one weight: mixed scale groups requantized to GROUP (`affine`),
        mixed widths widened to the widest, the file's super-blocks kept where every part has
        them."""
        if len({p.group for p in parts}) > 1:
            parts = [p.affine() for p in parts]
        bits = max(p.bits for p in parts)
        parts = [p if p.bits == bits else p.widened(bits) for p in parts]
        blocks = None
        if all(p.blocks is not None for p in parts):
            blocks = SuperBlocks.cat_rows([p.blocks for p in parts])
        return QuantizedWeight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.offsets for p in parts]),
            bits,
            blocks,
        )

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        blocks = None if self.blocks is None else self.blocks.map(lambda t: t[index])
        return QuantizedWeight(
            self.codes[index], self.scales[index], self.offsets[index], self.bits, blocks
        )

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        n, k = self.codes.shape
        codes = self.codes.reshape(n, k // self.group, self.group).float()
        return (codes * self.scales[..., None] + self.offsets[..., None]).reshape(n, k)

    def affine(self) -> QuantizedWeight:
        """The weight with a scale and offset per GROUP: itself, or (Q6_K, 16 values a scale)
        requantized to 8 bits, within a 510th of each group's range (for torch's int4 kernel,
        stacking with other types, slices that split a super-block)."""
        return self if self.group == GROUP else QuantizedWeight.quantize(self.dequantize(), 8)

    def halves(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """torch's int4 kernel's form: 4-bit codes c with w = (c - 8) s + z per group. 8-bit
        codes q = 16 hi + lo split into [W_hi | W_lo] over the input written twice:
        [x | x] @ [W_hi | W_lo]^T = x @ W^T with W_hi = 16 d hi and W_lo = d lo + m.
        Returns codes [N, K h], scales and zeros [N, K h / GROUP], h = 1 or 2 halves."""
        d, m = self.scales, self.offsets
        if self.bits == 4:  # (q - 8) d + (m + 8 d) = d q + m
            return self.codes, d, m + 8 * d
        # hi half: (hi - 8) 16d + 128d = 16 d hi; lo half: (lo - 8) d + (8 d + m) = d lo + m
        codes = torch.cat([self.codes >> 4, self.codes & 15], dim=1)
        return codes, torch.cat([16 * d, d], 1), torch.cat([128 * d, 8 * d + m], 1)


def _form(weight: QuantizedWeight) -> tuple[int, int, bool]:
    """What decides a weight's layout in memory: code width, inputs per scale, the file's
    super-blocks or plain tables."""
    return weight.bits, weight.group, weight.blocks is not None


@dataclass
class QuantizedRows:
    """One projection's output rows in segments of different forms, each kept as its file
    holds it (a Q4_K_M file's q and k in Q4_K beside a v in Q6_K; Q5_0 beside Q8_0): stacking
    them into one matrix would widen the narrower codes (more bytes read per token) and
    requantize a Q6_K (values off the file's). The kernels write each segment's outputs side
    by side; a backend that takes one matrix gets `merged()`."""

    parts: list[QuantizedWeight]

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    def merged(self) -> QuantizedWeight:
        """One matrix of all rows (widened, Q6_K requantized to GROUP: see QuantizedWeight)."""
        return QuantizedWeight._stack(self.parts)

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        return torch.cat([p.dequantize() for p in self.parts])

    def columns(self, start: int, end: int) -> QuantizedWeight | QuantizedRows:
        return QuantizedWeight.cat_rows([p.columns(start, end) for p in self.parts])

    def rows(self, index: torch.Tensor) -> QuantizedWeight | QuantizedRows:
        """Rows `index` (a tensor-parallel share of each segment, in order): each segment's
        own, where the index visits the segments in order; else of the merged matrix."""
        sizes = torch.tensor([p.out_features for p in self.parts])
        ends = sizes.cumsum(0)
        segment = torch.bucketize(index, ends, right=True)  # [R] which part each row is in
        if not bool((segment[1:] >= segment[:-1]).all()):
            return self.merged().rows(index)
        starts = ends - sizes
        picked = [
            p.rows(index[segment == i] - starts[i])
            for i, p in enumerate(self.parts)
            if bool((segment == i).any())
        ]
        return QuantizedWeight.cat_rows(picked)


QUANTIZED = (QuantizedWeight, QuantizedRows)  # what a quantized projection's weight may be


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


def tandem_kernel_available() -> bool:
    from kernels import cpu

    return cpu.load() is not None


def choose_backend(device: torch.device | str, out_features: int) -> str:
    """TANDEM_QUANT_KERNEL if set, else the first of BACKENDS that runs on `device`."""
    forced = os.environ.get("TANDEM_QUANT_KERNEL")
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"TANDEM_QUANT_KERNEL must be one of {BACKENDS}, got {forced!r}")
    if torch.device(device).type != "cpu":
        return "dense"
    runs = {
        "tandem": tandem_kernel_available,
        "int4pack": lambda: out_features % 16 == 0 and int4_kernel_available(),
        "dense": lambda: True,
    }
    if forced is not None:
        if not runs[forced]():
            raise RuntimeError(f"TANDEM_QUANT_KERNEL={forced} does not run on this machine")
        return forced
    return next(b for b in BACKENDS if runs[b]())


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tandem kernel's activations: x [M, K] -> int8 codes p [M, K] (as float) and scales
    dx [M, K / GROUP] with x ~= dx p, dx = max|x| / 127 per group, p rounded half to even."""
    m, k = x.shape
    groups = x.float().reshape(m, k // GROUP, GROUP)
    dx = groups.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    return (groups * inv[..., None]).round().reshape(m, k), dx


def reference_matmul(x: torch.Tensor, weight: QuantizedWeight, backend: str) -> torch.Tensor:
    """In plain torch (float64 where the kernel's sums are exact), what `backend` computes."""
    if backend == "tandem":
        return _reference_tandem(x, weight)
    if backend == "int4pack":  # bf16 inputs and parameters, float32 sums, a bf16 result
        codes, scales, zeros = weight.affine().halves()  # [N, K h], [N, K h / GROUP]
        n = codes.shape[0]
        c = codes.float().reshape(n, -1, GROUP) - 8
        s, z = scales.bfloat16().float(), zeros.bfloat16().float()
        w = (c * s[..., None] + z[..., None]).reshape(n, -1, weight.in_features).sum(1)
        return (x.bfloat16().float() @ w.t()).bfloat16().float()
    return x.float() @ weight.dequantize().t()


def _reference_tandem(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:  # [M, N]
    """The kernel's order for each output: acc = fma(float(D), d dx, acc), then
    acc = fma(m, sx, acc), group after group, D the exact integer dot product of the group's
    codes and activation codes. Q6_K (w = s (q - 32), a scale per 16): for each half of a
    group acc = fma(float(D - 32 S), s dx, acc), S the half's sum of activation codes (an
    exact integer). fma emulated in long double (64-bit mantissas: a float32 product is exact
    there, so only a sum's rounding twice could differ, a 2^-40 chance)."""
    p, dx = quantize_activations(x)  # [M, K], [M, G]
    m, k = p.shape
    n, per = weight.out_features, GROUP // weight.group  # scales per group: 1, or Q6_K's 2
    p = p.reshape(m, k // GROUP, per, weight.group).double()
    codes = weight.codes.double().reshape(n, k // GROUP, per, weight.group)
    dots = torch.einsum("nghk,mghk->mghn", codes, p)  # [M, G, per, N] exact
    scale = weight.scales.reshape(n, -1, per).permute(1, 2, 0)[None] * dx[..., None, None]

    def fma(a: torch.Tensor, b: torch.Tensor, c: np.ndarray) -> np.ndarray:
        wide = np.longdouble
        return (a.numpy().astype(wide) * b.numpy().astype(wide) + c).astype(np.float32)

    acc = np.zeros((m, n), np.float32)
    if per == 2:
        assert torch.equal(weight.offsets, -32 * weight.scales), "group 16 is Q6_K's form"
        dots = (dots - 32 * p.sum(-1)[..., None]).float()  # [M, G, 2, N] exact integers
        for g in range(k // GROUP):
            acc = fma(dots[:, g, 0], scale[:, g, 0], acc)
            acc = fma(dots[:, g, 1], scale[:, g, 1], acc)
        return torch.from_numpy(acc)
    sx = dx * p.sum(-1)[:, :, 0].float()  # [M, G] float32, as the kernel's dx * float(sum p)
    offset = weight.offsets.t()[None].expand(m, -1, -1)  # [M, G, N]
    for g in range(k // GROUP):
        acc = fma(dots[:, g, 0].float(), scale[:, g, 0], acc)
        acc = fma(offset[:, g], sx[:, g, None].expand(m, n), acc)
    return torch.from_numpy(acc)


class Segment(NamedTuple):
    """A run of a projection's output rows in the tandem kernel's layout (`_pack_tandem`)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int
    rows: int


def segment_operands(segments: list[Segment]) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """The quantized kernels' operands for segments side by side: (codes, scales, offsets) of
    each, then each one's code width and rows."""
    weights = [t for s in segments for t in (s.codes, s.scales, s.offsets)]
    return weights, [s.bits for s in segments], [s.rows for s in segments]


class QuantizedLinear(nn.Module):
    """y = x W^T + b over a QuantizedWeight (or QuantizedRows: segments side by side), on the
    backend `choose_backend` picks (a weight format of engine.models.layers.Linear; its
    tensors stay where they were built)."""

    def __init__(
        self,
        weight: QuantizedWeight | QuantizedRows,
        bias: torch.Tensor | None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        backend: str | None = None,
    ):
        super().__init__()
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.backend = backend or choose_backend(device, weight.out_features)
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        parts = weight.parts if isinstance(weight, QuantizedRows) else [weight]
        self.segments: list[Segment] = []  # the tandem kernel's, in output order
        if self.backend == "tandem":
            self.segments = [Segment(*_pack_tandem(p), p.bits, p.out_features) for p in parts]
            self._operands = segment_operands(self.segments)  # linear_out's lists
        elif self.backend == "int4pack":
            one = weight.merged() if isinstance(weight, QuantizedRows) else weight
            codes, scales, zeros = one.affine().halves()
            self.halves = codes.shape[1] // weight.in_features
            self.packed = _pack_int4(codes)  # [N, K h / 2] the kernel's layout
            params = torch.stack([scales, zeros], dim=-1)  # [N, G h, 2]
            self.params = params.transpose(0, 1).contiguous().bfloat16()
        else:
            self.dense = weight.dequantize().to(device=device, dtype=dtype)  # [N, K]
        self.bits = parts[0].bits if len(parts) == 1 else None  # the codes' width, if one

    @property
    def codes(self) -> torch.Tensor:  # the tiles of a single-segment weight
        return self._single().codes

    @property
    def scales(self) -> torch.Tensor:
        return self._single().scales

    @property
    def offsets(self) -> torch.Tensor:
        return self._single().offsets

    def _single(self) -> Segment:
        if len(self.segments) != 1:
            raise ValueError(f"a {self.backend} weight of {len(self.segments)} segments, not one")
        return self.segments[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, N] in x's dtype
        if self.backend == "tandem":
            y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
            xf = x.float().contiguous()
            torch.ops.tandem_cpu.linear_out(xf, *self._operands, self.bias, y)
            return y.to(x.dtype)
        if self.backend == "int4pack":
            xb = x.bfloat16()
            if self.halves == 2:
                xb = torch.cat([xb, xb], dim=-1)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP, self.params)
            y = y.to(x.dtype)
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.dense, self.bias)


def _pack_tandem(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tandem kernel's layout (kernels/cpu/quant_matmul.cpp): output rows in tiles of TILE
    (zero rows pad the last), each tile's group a unit of 64-byte chunks, chunk c holding row
    j's codes for inputs 4c..4c+3 at bytes 4j..4j+3 (8 chunks; 4-bit codes: chunk c in the low
    nibbles of 4 chunks, chunk c + 4 in the high ones; 5- and 6-bit codes: their low 4 bits so,
    then their hb = bits - 4 higher bits in hb vectors of 64 bytes, chunk c's byte b's at bit
    hb (c % (8 / hb)) of byte b of vector c / (8 / hb)).
    Returns codes [T, G, unit bytes] and scales and offsets: [T, G, TILE] float16 where every
    value is exact in it, else float32 (offsets of -2^(bits - 1) d, a centered Q4_0, Q5_0 or
    Q8_0: the scales passed twice, the kernel forms them); a K-quant's in its file's form,
    uint8 [T, K / 256, B]: per tile and super-block the 16 rows' float16 d (Q4_K, Q5_K: -dmin
    for the offsets), then its sub-blocks' 16 bytes each, 6-bit scales (mins) or Q6_K's 16
    int8 scales (B = 160 or 288; Q6_K's offsets are -32 s, not stored: the same tensor is
    passed twice)."""
    assert weight.group == GROUP or weight.blocks is not None, "Q6_K keeps its super-blocks"
    n, k = weight.codes.shape
    tiles, groups = -(-n // TILE), k // GROUP
    rows = tiles * TILE
    codes = F.pad(weight.codes, (0, 0, 0, rows - n)).reshape(tiles, TILE, groups, 8, 4)
    chunks = codes.permute(0, 2, 3, 1, 4).reshape(tiles, groups, 8, 4 * TILE)
    if weight.bits == 8:
        parts = [chunks]
    else:
        low = chunks & 15
        parts = [low[:, :, :4] | (low[:, :, 4:] << 4)]
        hb = weight.bits - 4  # 5 and 6 bits: the higher hb bits, 8 / hb chunks to a byte
        if hb:
            high = (chunks >> 4).reshape(tiles, groups, hb, 8 // hb, 4 * TILE)
            sliced = high[:, :, :, 0].clone()  # [T, G, hb, 64]: chunk c at byte c / (8 / hb)
            for field in range(1, 8 // hb):
                sliced |= high[:, :, :, field] << (hb * field)
            parts.append(sliced)
    packed = torch.cat([t.reshape(tiles, groups, -1) for t in parts], -1).contiguous()

    def by_tile(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [T, G, TILE]
        return F.pad(t, (0, 0, 0, rows - n)).reshape(tiles, TILE, t.shape[1]).transpose(1, 2)

    if weight.blocks is not None:
        b, supers = weight.blocks, k // SUPER

        def super_blocks(d: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
            head = by_tile(d).contiguous().view(torch.uint8)  # [T, S, 2 TILE]
            sub = by_tile(sub.view(torch.uint8)).reshape(tiles, supers, -1)
            return torch.cat([head, sub], -1).contiguous()

        scales = super_blocks(b.d, b.scales)
        offsets = scales if b.mins is None else super_blocks(b.neg_dmin, b.mins)
        return packed, scales, offsets
    params = [by_tile(weight.scales), by_tile(weight.offsets)]
    if all(torch.equal(p.half().float(), p) for p in params):  # the file's own float16
        params = [p.half().contiguous() for p in params]
        if torch.equal(weight.offsets, -(2 ** (weight.bits - 1)) * weight.scales):
            return packed, params[0], params[0]  # centered (Q4_0, Q5_0, Q8_0): m from d
    return packed, params[0].contiguous(), params[1].contiguous()


def _pack_int4(codes: torch.Tensor, rows_per_chunk: int = 4096) -> torch.Tensor:
    """torch's int4 kernel's packed layout, built a slice of rows at a time (it wants int32
    codes: four bytes per code for the whole matrix at once would be the largest allocation of
    a load). Rows pack independently: slices of a multiple of 16 rows concatenate to the whole."""
    chunks = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes[i : i + rows_per_chunk].int(), 1)
        for i in range(0, codes.shape[0], rows_per_chunk)
    ]
    return torch.cat(chunks) if len(chunks) > 1 else chunks[0]


class QuantizedEmbedding(nn.Module):
    """Rows of a QuantizedWeight dequantized on lookup (d q + m, as QuantizedWeight.dequantize).
    With the C++ kernels the table is in their tiled layout: a tied LM head's own (`from_head`,
    no second copy) or its own; else 4-bit codes two per byte."""

    def __init__(self, weight: QuantizedWeight, device: torch.device | str, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.rows, self.in_features = dtype, weight.out_features, weight.in_features
        self.tiles: tuple | None = None  # (codes, scales, offsets, bits): _pack_tandem's layout
        if torch.device(device).type == "cpu" and tandem_kernel_available():
            self.tiles = (*_pack_tandem(weight), weight.bits)
            return
        codes = weight.codes
        if weight.bits == 4:
            codes = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [V, K / 2]
        self.codes = codes.to(device)
        self.scales, self.offsets = weight.scales.to(device), weight.offsets.to(device)
        self.bits = weight.bits

    @classmethod
    def from_head(cls, head: QuantizedLinear, dtype: torch.dtype) -> QuantizedEmbedding:
        """The embedding tied to `head` (the tandem backend), reading its tiles."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.dtype, self.rows, self.in_features = dtype, head.out_features, head.in_features
        self.tiles = (head.codes, head.scales, head.offsets, head.bits)
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, K]
        if self.tiles is not None:
            rows = torch.ops.tandem_cpu.dequantize_rows(
                *self.tiles, self.rows, self.in_features, ids.long().contiguous()
            )
            return rows.to(self.dtype)
        codes = self.codes[ids]
        if self.bits == 4:
            codes = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(codes.shape[0], -1)
        rows = QuantizedWeight(codes, self.scales[ids], self.offsets[ids], self.bits)
        return rows.dequantize().to(self.dtype)
