"""A GGUF file's tensors in their own quantized form, for an architecture's GGUF weight map.

The file is memory-mapped (gguf.GGUFReader) and each tensor's blocks are decoded straight into
codes with a scale and offset per 32 values (engine/models/gguf_blocks.py): no float32 copy of
a projection ever exists. Norms and biases are read as float32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader

from engine.models.gguf_blocks import decode, dequantize_rows
from engine.models.quantized import QuantizedWeight


class GGUFWeights:
    """A GGUF file's tensors by name; quantized matrices as QuantizedWeight."""

    def __init__(self, path: str | Path):
        try:
            self.reader = GGUFReader(str(path))
        except Exception as e:  # not GGUF, truncated
            raise ValueError(f"cannot read GGUF file {str(path)!r}: {e}") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def _tensor(self, name: str):
        if name not in self.tensors:
            raise ValueError(f"GGUF file has no tensor {name!r}")
        return self.tensors[name]

    def dense(self, name: str) -> torch.Tensor:  # float32, the tensor's shape (rows first)
        t = self._tensor(name)
        in_features = int(t.shape[0])
        rows = np.asarray(t.data).reshape(-1, t.data.shape[-1])
        return dequantize_rows(rows, t.tensor_type, in_features).reshape(
            tuple(reversed([int(s) for s in t.shape]))
        )

    def quantized(self, name: str, row_order: torch.Tensor | None = None) -> QuantizedWeight:
        t = self._tensor(name)
        in_features = int(t.shape[0])
        rows = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # bytes, or floats for F32/F16
        weight = decode(rows, t.tensor_type, in_features)
        return weight if row_order is None else weight.rows(row_order)
