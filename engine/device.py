"""Host-built step inputs onto the model's device."""

from __future__ import annotations

import dataclasses

import torch


def to_device(obj, device: torch.device):
    """obj with every tensor in it (itself, or inside dataclass fields, lists and tuples) copied
    to device without waiting; on CPU, obj itself."""
    if device.type == "cpu":
        return obj
    return _moved(obj, device)


def _moved(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, list | tuple):
        return type(obj)(_moved(v, device) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _moved(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **fields)
    return obj
