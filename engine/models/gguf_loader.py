"""A GGUF file's tensors in their own quantized form, for an architecture's GGUF weight map.

The file is memory-mapped and each tensor's blocks are decoded straight into codes with a scale
and offset per 32 values (engine/models/gguf_blocks.py): no float32 copy of a projection ever
exists. Norms and biases are read as float32. Only the header's tensor table is parsed: the
metadata (a vocabulary of 50k-260k strings, which gguf.GGUFReader makes one numpy view per
string and part of) is stepped over, its values never built.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from engine.models.gguf_blocks import decode, dequantize_rows
from engine.models.quantized import QuantizedWeight

MAGIC = 0x46554747  # "GGUF" little-endian
STRING, ARRAY = 8, 9  # GGUF value types with a length; the others are scalars (struct codes):
SCALARS = dict(zip([0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12], "BbHhIif?Qqd", strict=True))
VALUES = {T.F32: np.float32, T.F16: np.float16}  # types read as values, not bytes


@dataclass(frozen=True)
class GGUFTensor:
    shape: tuple[int, ...]  # ggml's order: a row's length (ne0) first
    tensor_type: T
    data: np.ndarray  # [rows, bytes per row] uint8 (F32 / F16: [rows, ne0] values), mapped
    # (1-D tensors: without the rows; gguf.GGUFReader's shapes)


class _Header:
    """Steps through a GGUF header in the mapped file: offsets and little-endian scalars."""

    def __init__(self, buf: memoryview):
        self.buf, self.offset = buf, 0

    def read(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.read("Q")
        self.offset += n
        return bytes(self.buf[self.offset - n : self.offset]).decode()

    def skip(self, value_type: int) -> None:
        if value_type == STRING:
            n = self.read("Q")  # (read first: it moves the offset)
            self.offset += n
        elif value_type == ARRAY:
            item_type, count = self.read("I"), self.read("Q")
            if item_type in SCALARS:
                self.offset += count * struct.calcsize(SCALARS[item_type])
            else:
                for _ in range(count):
                    self.skip(item_type)
        else:
            self.offset += struct.calcsize(SCALARS[value_type])


def _open(path: str | Path) -> tuple[np.memmap, _Header, int, int]:
    """The mapped file, its header stepped past the counts, the tensors' and the metadata's."""
    data = np.memmap(path, mode="r")
    h = _Header(memoryview(data))
    magic, version, num_tensors, num_values = h.read("I"), h.read("I"), h.read("Q"), h.read("Q")
    if magic != MAGIC or version not in (2, 3):
        raise ValueError(f"not a little-endian GGUF (version 2 or 3): {magic=:#x} {version=}")
    return data, h, num_tensors, num_values


def architecture(path: str | Path) -> str:
    """The file's general.architecture (the metadata stepped over up to it)."""
    _, h, _, num_values = _open(path)
    for _ in range(num_values):
        key, value_type = h.string(), h.read("I")
        if key == "general.architecture" and value_type == STRING:
            return h.string()
        h.skip(value_type)
    raise ValueError("no general.architecture in its metadata")


def read_tensors(path: str | Path) -> dict[str, GGUFTensor]:
    """The tensor table of a GGUF file (versions 2 and 3, little-endian), data mapped."""
    data, h, num_tensors, num_values = _open(path)
    alignment = 32
    for _ in range(num_values):
        key, value_type = h.string(), h.read("I")
        if key == "general.alignment" and value_type == 4:
            alignment = h.read("I")
        else:
            h.skip(value_type)
    table = []
    for _ in range(num_tensors):
        name = h.string()
        shape = tuple(h.read("Q") for _ in range(h.read("I")))
        table.append((name, shape, T(h.read("I")), h.read("Q")))
    start = -(-h.offset // alignment) * alignment
    tensors = {}
    for name, shape, qtype, offset in table:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        row_bytes, rows = shape[0] // block * block_bytes, int(np.prod(shape[1:], dtype=np.int64))
        raw = data[start + offset : start + offset + rows * row_bytes]
        if qtype in VALUES:  # (gguf.GGUFReader's shapes: rows first, values or bytes last)
            raw = raw.view(VALUES[qtype]).reshape(shape[::-1])
        else:
            raw = raw.reshape(*shape[:0:-1], row_bytes)
        tensors[name] = GGUFTensor(shape, qtype, raw)
    return tensors


class GGUFWeights:
    """A GGUF file's tensors by name; quantized matrices as QuantizedWeight."""

    def __init__(self, path: str | Path):
        try:
            self.tensors = read_tensors(path)
        except Exception as e:  # not GGUF, truncated
            raise ValueError(f"cannot read GGUF file {str(path)!r}: {e}") from None

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
