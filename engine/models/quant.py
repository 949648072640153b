"""Int8 weights for a draft model on CPU.

Per-output-channel symmetric int8 weights; activations are quantized per call (torch's x86 /
fbgemm dynamic quantized linear). A quarter of the weight bytes, and decode is memory-bound:
at one row many times faster than fp32, with a relative output error of a percent or two
(bench.choices measures both on Qwen2.5-0.5B's widest projection).

That error makes it unfit for the model whose outputs we return (they must match HF exactly),
but a draft model only proposes: the verifier keeps the target's output exact whatever the draft
says, and a slightly different draft costs some acceptance. Activations get one scale per call,
so outlier channels cost precision: with CPUs that have VNNI int8 dot products we use all 8
bits (7 bits on AVX2, where the u8 x s8 pair sums could saturate), and the models keep
down_proj, whose input has the largest outliers, in fp32. SmolLM2 drafting for itself accepted
0.48 of drafts with everything int8 and 7-bit activations, 0.71-0.75 with down_proj in fp32 or
8-bit activations (40-token greedy runs on 3 prompts).
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch


def int8_linear_available() -> bool:
    ops = torch.ops.quantized
    return (
        hasattr(ops, "linear_prepack")
        and hasattr(ops, "linear_dynamic")
        and torch.backends.quantized.engine in ("x86", "fbgemm")
    )


def pack_int8(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[out, in] fp32 weight -> the backend's packed int8 parameters."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp_(min=1e-12).double()
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated upstream, still supported
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qweight, bias)


@functools.cache
def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _cpu_has_vnni() -> bool:
    flags = _cpu_flags()
    return "avx512_vnni" in flags or "avx_vnni" in flags


def cpu_has_fast_bf16() -> bool:
    """bf16 dot products in hardware (AVX512-BF16 or AMX): what makes oneDNN's bf16 GEMMs fast
    (measured: a 512-token prefill of SmolLM2 2.4x float32's); without them bf16 runs through
    conversions, slower than float32."""
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def linear_int8(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    # reduce_range: 7-bit activations where int8 dot products could saturate (no VNNI).
    return torch.ops.quantized.linear_dynamic(x, packed, not _cpu_has_vnni())
