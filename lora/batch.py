"""Many adapters in one forward pass: adapter slots and the batched LoRA update (torch, or the
Triton shrink/expand kernels with the Triton backend).

`LoRASlots` keeps up to `max_loras` adapters resident as stacked weights, per layer and
projection: A [S + 1, in, R] and B [S + 1, R, out] (R = max_lora_rank, ranks below R padded with
zeros, the scale folded into B; slot 0 is all zeros). A step's `LoRABatch` maps each token row to
its request's slot, and every adapted projection adds, for the rows that have an adapter,

    y[t] += (x[t] A[slot(t)]) B[slot(t)]

two ways: an adapter with many rows in the step (a prefill chunk) gets two plain matmuls over its
segment of rows; the rows of adapters with few (decodes) are laid out slot-major, [slots, rows
per slot, in] (zero-padded), and run as one batched matmul against the stacks' own slot range
(a view: no weight is copied, each resident adapter's A and B is read once per step). Rows
without an adapter are skipped.

With the Triton attention backend the update runs as the SGMV kernels of kernels/triton_lora
instead: rows listed grouped by slot, one shrink and one expand launch per projection.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lora.adapter import LoRAAdapter, projection_shapes

if TYPE_CHECKING:
    from engine.models.config import ModelConfig

# Our fused projections and the PEFT modules inside them, in output order.
GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoRASlots:
    def __init__(
        self,
        cfg: ModelConfig,
        max_loras: int,
        max_rank: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.shapes = projection_shapes(cfg)
        self.device, self.dtype = torch.device(device), dtype
        self.max_loras, self.max_rank = max_loras, max_rank
        self.a: dict[tuple[int, str], torch.Tensor] = {}  # [S + 1, in, R]
        self.b: dict[tuple[int, str], torch.Tensor] = {}  # [S + 1, R, out]
        self.resident: list[LoRAAdapter | None] = [None] * (max_loras + 1)  # index 0 unused
        self.last_used = [0] * (max_loras + 1)
        self.clock = 0
        self.num_loads = 0
        # Tensor parallelism: shard(module, a, b) -> this rank's (a, b)
        # (engine.distributed.tensor_parallel.shard_lora), and `placed`, the slot changes the other
        # ranks have not been sent yet.
        self.shard = None
        self.placed: list[tuple[int, LoRAAdapter | None]] | None = None

    @torch.inference_mode()
    def activate(self, adapters: list[LoRAAdapter]) -> dict[int, int]:
        """Make these (distinct, at most max_loras) adapters resident; id(adapter) -> slot.
        Slots of adapters not in this step are reused least recently used first."""
        if len(adapters) > self.max_loras:
            raise ValueError(f"{len(adapters)} adapters in one step, max_loras={self.max_loras}")
        self.clock += 1
        wanted = {id(a) for a in adapters}
        slot_of = {}
        for adapter in adapters:
            slot = next((s for s in range(1, self.max_loras + 1) if self.resident[s] is adapter), 0)
            if not slot:
                free = [
                    s
                    for s in range(1, self.max_loras + 1)
                    if self.resident[s] is None or id(self.resident[s]) not in wanted
                ]
                slot = min(free, key=lambda s: (self.resident[s] is not None, self.last_used[s]))
                self.place(slot, adapter)
            self.last_used[slot] = self.clock
            slot_of[id(adapter)] = slot
        return slot_of

    @torch.inference_mode()
    def evict(self, adapter: LoRAAdapter) -> None:
        for s in range(1, self.max_loras + 1):
            if self.resident[s] is adapter:
                self.place(s, None)

    @torch.inference_mode()
    def place(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put an adapter in a slot, or (None) empty it; every rank replays rank 0's places."""
        if adapter is None:
            self._clear(slot)
            self.resident[slot] = None
        else:
            self._write(slot, adapter)
        if self.placed is not None:
            self.placed.append((slot, adapter))

    def _clear(self, slot: int) -> None:
        for key in self.a:
            self.a[key][slot].zero_()
            self.b[key][slot].zero_()

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        self._clear(slot)
        for (layer, proj), (a, b) in adapter.weights.items():
            if self.shard is not None:
                a, b = self.shard(proj, a, b)
            key = (layer, proj)
            if key not in self.a:
                size_in, size_out = self.shapes[proj]
                stack = dict(dtype=self.dtype, device=self.device)
                self.a[key] = torch.zeros(self.max_loras + 1, size_in, self.max_rank, **stack)
                self.b[key] = torch.zeros(self.max_loras + 1, self.max_rank, size_out, **stack)
            r = a.shape[1]
            if self.device.type == "cuda":  # page-locked: the copies need not wait for the device
                a, b = a.pin_memory(), b.pin_memory()
            a, b = a.to(self.device, non_blocking=True), b.to(self.device, non_blocking=True)
            self.a[key][slot, :, :r] = a
            self.b[key][slot, :r, :] = b
        self.resident[slot] = adapter
        self.num_loads += 1


# An adapter with more than this many rows in a step takes the segment path.
MAX_PACKED_ROWS = 8


def rows_by_slot(token_slots: list[int]) -> dict[int, list[int]]:
    """The token rows of each slot that has any (slot 0, no adapter, left out)."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot:
            by_slot.setdefault(slot, []).append(row)
    return by_slot


@dataclass
class PackedLoRABatch:
    """One forward pass's adapter rows for the torch path: segments and packed rows."""

    slots: LoRASlots
    segments: list[tuple[int, torch.Tensor]]  # (slot, [m] int64 rows): many rows, one adapter
    # The other rows with an adapter, packed slot-major over the slot range [lo, hi):
    rows: torch.Tensor | None  # [n] int64 token rows; None: no such rows
    packed: torch.Tensor | None  # [n] int64 index into [(hi - lo) * width]
    slot_range: tuple[int, int] = (0, 0)  # lo, hi
    width: int = 0  # rows per slot in the packed layout

    @classmethod
    def build(cls, slots: LoRASlots, token_slots: list[int]) -> PackedLoRABatch | None:
        """token_slots: a slot per token row (0 = no adapter); None when no row has one."""
        segments, few = [], {}
        for slot, members in rows_by_slot(token_slots).items():
            if len(members) > MAX_PACKED_ROWS:
                segments.append((slot, torch.tensor(members, dtype=torch.long)))
            else:
                few[slot] = members
        if not few:
            return cls(slots, segments, None, None) if segments else None
        lo, hi = min(few), max(few) + 1
        width = max(len(m) for m in few.values())
        rows = [r for members in few.values() for r in members]
        packed = [(s - lo) * width + j for s, members in few.items() for j in range(len(members))]
        return cls(
            slots,
            segments,
            torch.tensor(rows, dtype=torch.long),
            torch.tensor(packed, dtype=torch.long),
            (lo, hi),
            width,
        )

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, sum of outs] += the group's LoRA updates of x [T, in], in place."""
        xs = [x.index_select(0, rows) for _, rows in self.segments]  # [m, in] each
        lo, hi = self.slot_range
        xp = None
        if self.rows is not None:  # [hi - lo, width, in], zero where a slot has fewer rows
            xp = x.new_zeros((hi - lo) * self.width, x.shape[1])
            xp.index_copy_(0, self.packed, x.index_select(0, self.rows))
            xp = xp.view(hi - lo, self.width, x.shape[1])
        offset = 0
        for proj in GROUPS[group]:
            size_out = self.slots.shapes[proj][1]
            a, b = self.slots.a.get((layer, proj)), self.slots.b.get((layer, proj))
            if a is not None:
                out = y[:, offset : offset + size_out]
                for (slot, rows), x_seg in zip(self.segments, xs, strict=True):
                    out.index_add_(0, rows, (x_seg @ a[slot]) @ b[slot])  # [m, out]
                if xp is not None:
                    shrunk = torch.bmm(xp, a[lo:hi])  # [hi - lo, width, R]
                    delta = torch.bmm(shrunk, b[lo:hi]).view(-1, size_out)  # [.., out]
                    out.index_add_(0, self.rows, delta.index_select(0, self.packed))
            offset += size_out


@dataclass
class KernelLoRABatch:
    """One forward pass's adapter rows for the Triton SGMV kernels: grouped by slot."""

    slots: LoRASlots
    rows: torch.Tensor  # [n] int32 token rows, segment after segment
    seg_starts: torch.Tensor  # [G + 1] int32
    seg_slots: torch.Tensor  # [G] int32
    max_seg_len: int

    @classmethod
    def build(cls, slots: LoRASlots, token_slots: list[int]) -> KernelLoRABatch | None:
        """token_slots: a slot per token row (0 = no adapter); None when no row has one."""
        by_slot = rows_by_slot(token_slots)
        if not by_slot:
            return None
        order = sorted(by_slot)
        starts = [0, *itertools.accumulate(len(by_slot[slot]) for slot in order)]
        return cls(
            slots,
            torch.tensor([r for slot in order for r in by_slot[slot]], dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32),
            torch.tensor(order, dtype=torch.int32),
            max(len(m) for m in by_slot.values()),
        )

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """As PackedLoRABatch.apply, in the shrink and expand kernels."""
        from kernels.triton_lora import lora_expand, lora_shrink

        segments = (self.rows, self.seg_starts, self.seg_slots, self.max_seg_len)
        offset = 0
        for proj in GROUPS[group]:
            a, b = self.slots.a.get((layer, proj)), self.slots.b.get((layer, proj))
            if a is not None:
                lora_expand(lora_shrink(x, a, *segments), b, y, offset, *segments)
            offset += self.slots.shapes[proj][1]


LoRABatch = PackedLoRABatch | KernelLoRABatch
