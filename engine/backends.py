"""The kernels a model runner uses, chosen once when it is built: the torch references (the CPU
path) or the Triton kernels (CUDA, or Triton's interpreter on CPU).

Everything that differs between the two is here: how a step's attention metadata is laid out
(buckets and prefill spans for the reference, one variable-length batch for the kernels), how
its LoRA rows are batched (packed matmuls, or the SGMV kernels' segments), which kernel
verifies drafts, and whether decode steps may run from the CUDA-graph runner's static buffers
(they need the variable-length kernels).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import (
    AttentionMetadata,
    Layout,
    bucketed_metadata,
    row_metadata,
    varlen_metadata,
)
from engine.inputs import FlatInputs
from kernels import reference
from lora.batch import KernelLoRABatch, LoRABatch, LoRASlots, PackedLoRABatch

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class Backend:
    name: str  # "torch" | "triton"
    static_buffers: bool  # the CUDA-graph runner can serve its decode steps
    verify_kernel: Callable  # engine.rejection.VerifyKernel
    layout: Layout  # a step's attention metadata
    lora_batch: Callable[[LoRASlots, list[int]], LoRABatch | None]  # its adapter rows

    def metadata(
        self,
        flat: FlatInputs,
        slot_mapping: torch.Tensor,
        block_size: int,
        windows: tuple[int | None, ...],
        rows: bool,
    ) -> AttentionMetadata | dict[int | None, AttentionMetadata]:
        """windows: the layers' attention windows (ModelConfig.windows); several give a layout
        per window. rows: the model's layers run on the C++ kernels (the layers' fuse), whose
        attention takes every row on its own (RowAttention) with each layer's window."""
        args = (flat.seq_lens, flat.query_lens, flat.tables, slot_mapping, block_size)
        if rows:
            return row_metadata(*args)
        if len(windows) == 1:
            return self.layout(*args, windows[0])
        return {w: self.layout(*args, w) for w in windows}


TORCH = Backend(
    "torch",
    static_buffers=False,
    verify_kernel=reference.rejection_verify,
    layout=bucketed_metadata,
    lora_batch=PackedLoRABatch.build,
)


def triton_backend() -> Backend:
    from kernels.triton_rejection import rejection_verify  # imports triton

    return Backend(
        "triton",
        static_buffers=True,
        verify_kernel=rejection_verify,
        layout=varlen_metadata,
        lora_batch=KernelLoRABatch.build,
    )


def resolve_backend(name: str, device: torch.device | str = "cpu") -> Backend:
    """ "auto": Triton on CUDA, else the torch reference; "triton" on CPU needs
    TRITON_INTERPRET=1 (triton's interpreter)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        name = "triton" if on_cuda else "torch"
    elif name == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "attention_backend='triton' needs a CUDA device or TRITON_INTERPRET=1 (set before "
            "triton is imported)"
        )
    return triton_backend() if name == "triton" else TORCH
