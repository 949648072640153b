"""CPU tensors in transparent huge pages (2 MiB): the weights and the KV cache.

A decode step streams every weight, and the KV cache its rows attend, once: on a CPU its speed
is how fast one core reads memory. In 4 KiB pages a stream crosses a page every 64 cache lines;
each needs a TLB entry (in a VM a two-level page walk) and the hardware prefetchers stop at
every boundary. The same AVX-512 sum over 128 MB on the 2-core Xeon VM: 11.2 GB/s from 4 KiB
pages, 13.9 GB/s from huge pages (bench/RESULTS.md "Huge pages").

Linux backs a private anonymous mapping advised MADV_HUGEPAGE with huge pages when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise` (the usual default); torch
and glibc advise nothing, so their tensors get 4 KiB pages under `madvise`. Elsewhere (`never`,
other systems, other devices) these are plain torch allocations.

Memory: a huge page is backed whole when first touched, so the weights share one mapping (each
storage's start rounded to 64 bytes) rather than a mapping each; moving them there copies one
storage at a time, so the load's peak grows by the largest, not by the model.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

HUGE = 2 << 20  # bytes of a huge page on x86-64 and arm64 (4 KiB base pages)
ALIGN = 64  # a storage's start in the arena: a cache line (and any element size)
MIN_BYTES = 64 << 10  # smaller storages stay where they are (norm weights, biases)
_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether advised anonymous memory gets huge pages here."""
    try:
        mode = _MODE.read_text()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in mode or "[madvise]" in mode)


def _span(nbytes: int) -> int:
    """Bytes to map so that nbytes from the first huge-page boundary in the mapping end inside
    whole huge pages: the boundary is up to HUGE - 4 KiB in, and the kernel backs only a huge
    page that lies entirely inside the mapping (a tail that reaches past the last whole one, or
    an arena under HUGE that starts late, would stay in 4 KiB pages)."""
    return -(-nbytes // HUGE) * HUGE + HUGE


def _region(nbytes: int) -> tuple[mmap.mmap, int]:
    """Fresh (zero) anonymous memory advised huge, and the offset in it of a huge-page boundary
    followed by whole huge pages holding nbytes."""
    region = mmap.mmap(-1, _span(nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    address = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    return region, -address % HUGE


def _bytes(region: mmap.mmap, offset: int, nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] at offset in region, a storage of its own that keeps the region mapped
    (torch.frombuffer holds the buffer)."""
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)


def zeros(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape) in huge pages where they are available (the KV cache)."""
    device = torch.device(device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < HUGE or not available():
        return torch.zeros(*shape, dtype=dtype, device=device)
    region, skip = _region(nbytes)
    return _bytes(region, skip, nbytes).view(dtype).view(shape)


def move_storages(tensors: Iterable[torch.Tensor]) -> int:
    """Every CPU storage of at least MIN_BYTES behind `tensors` copied into one huge-page arena
    (each still a storage of its own size), each tensor re-pointed in place (set_: views keep
    their offsets and strides, and whoever holds the tensor object sees the new memory).
    Returns the bytes moved. Every tensor that shares a moved storage must be among `tensors`,
    else the old copy stays alive beside the new."""
    groups: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() >= MIN_BYTES:
            groups.setdefault(storage.data_ptr(), (storage, []))[1].append(t)
    if not groups or not available():
        return 0
    starts, total = [], 0
    for storage, _ in groups.values():
        starts.append(total)
        total += -(-storage.nbytes() // ALIGN) * ALIGN
    region, skip = _region(total)
    with torch.no_grad():
        for start, key in zip(starts, list(groups), strict=True):
            storage, holders = groups.pop(key)  # the old copy goes once its holders move
            new = _bytes(region, skip + start, storage.nbytes())
            new.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            for t in holders:
                t.set_(new.untyped_storage(), t.storage_offset(), t.size(), t.stride())
            del storage, holders
    return total


def module_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor a module tree holds: parameters, buffers, and tensors in its attributes
    (also inside tuples, lists and dicts: a fused layer's operands)."""

    def walk(value, depth: int = 0):
        if isinstance(value, torch.Tensor):
            yield value
        elif depth < 3 and isinstance(value, (tuple, list)):
            for item in value:
                yield from walk(item, depth + 1)
        elif depth < 3 and isinstance(value, dict):
            for item in value.values():
                yield from walk(item, depth + 1)

    for m in module.modules():
        for name, value in vars(m).items():
            if name != "_modules":  # children are visited by modules()
                yield from walk(value)
