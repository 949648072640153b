"""What the Triton kernels share."""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for operands stored in dtype: float32 stays float32 (Triton's
    default on NVIDIA rounds it to TF32's 10-bit mantissa; the torch path is the oracle);
    bf16/fp16 values are exact in TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"
