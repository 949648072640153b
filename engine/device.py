"""Host-built step inputs onto the model's device."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

_NUMPY = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def host_tensor(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A CPU tensor of a flat list of Python numbers, built through numpy: torch.tensor(list)
    converts element by element (several times slower: bench.choices), and a step
    builds several such inputs for every request it runs."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY[dtype]))


def padded_rows(
    rows: list[list[int]],
    width: int,
    num_rows: int | None = None,
    dtype: torch.dtype = torch.int32,
) -> torch.Tensor:
    """[num_rows or len(rows), width] CPU tensor (int32 or int64): each row cut or padded with
    0 (the null block) to width; rows past len(rows) all 0. One conversion for the table."""
    pad = [0] * width
    flat = []
    for row in rows:
        flat += row[:width]
        if len(row) < width:
            flat += pad[: width - len(row)]
    num_rows = len(rows) if num_rows is None else num_rows
    flat += [0] * (width * (num_rows - len(rows)))
    return host_tensor(flat, dtype).view(num_rows, width)


def to_device(obj, device: torch.device):
    """obj with every tensor in it (itself, or inside dataclass fields, lists and tuples) copied
    to device without waiting; on CPU, obj itself."""
    if device.type == "cpu":
        return obj
    return map_tensors(obj, lambda t: staged(t, device).to(device, non_blocking=True))


def staged(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t ready for a copy to device that does not block the host: a CPU tensor bound for CUDA
    goes to page-locked memory (torch's caching host allocator: cheap after warm-up), since a
    copy from pageable memory may wait for the stream's earlier work, stalling the host
    behind a step in flight instead of letting it prepare the next."""
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory()
    return t


def map_tensors(obj, fn):
    """obj with fn applied to every tensor in it (itself, or inside dataclass fields, lists and
    tuples); anything else is kept as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list | tuple):
        return type(obj)(map_tensors(v, fn) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **fields)
    return obj


class HostCopy:
    """A CPU copy of obj (tensors, or lists, tuples and dataclasses holding them, as
    map_tensors walks them), queued now behind the work that computes its tensors; wait()
    blocks until they have landed and returns it. Work queued after the copies (the next step)
    does not delay them."""

    def __init__(self, obj, device: torch.device | None = None):
        """device: where obj's tensors are, if known; a CPU obj is its own copy."""
        self.events = []
        if device is not None and device.type == "cpu":
            self.copy = obj
            return
        devices = set()

        def copy(t: torch.Tensor) -> torch.Tensor:
            devices.add(t.device)
            return t.to("cpu", non_blocking=True)

        self.copy = map_tensors(obj, copy)
        for device in {d for d in devices if d.type == "cuda"}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.events.append(event)

    def wait(self):
        for event in self.events:
            event.synchronize()
        self.events = []
        return self.copy


def to_host(obj):
    """A CPU copy of obj (see HostCopy), waiting for its devices once."""
    return HostCopy(obj).wait()
