"""What a step feeds the model: each request's tokens, and under async scheduling the tokens
the step in flight sampled, which reach the inputs on the device before they reach the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention import slot_ids
from engine.device import host_tensor, to_device

if TYPE_CHECKING:
    from engine.request import Request


@dataclass(slots=True)
class ForwardItem:
    """Tokens of one request to run through the model at consecutive positions from `start`.
    Async scheduling: when `last_from` is set, the last token is not known on the host yet;
    it is row `last_from` of the previous step's sampled tokens, still on the device."""

    request: Request
    start: int
    token_ids: list[int]
    last_from: int | None = None


@dataclass
class SampledTokens:
    """A launched step's sampled tokens on the device, one per request that sampled (the first
    token it emits): the next step's inputs, before they reach the host."""

    tokens: torch.Tensor  # [num_requests] int64, on the device
    row_of: dict[Request, int]


def pending_inputs(items: list[ForwardItem], q: int | None = None) -> tuple[list[int], list[int]]:
    """(flat positions, rows of the previous step's tokens) of the items' tokens still on the
    device; items laid out back to back, or every q positions when q is given."""
    positions, rows, offset = [], [], 0
    for b, item in enumerate(items):
        n = len(item.token_ids)
        if item.last_from is not None:
            positions.append((b * q if q else offset) + n - 1)
            rows.append(item.last_from)
        offset += n
    return positions, rows


def fill_pending(
    ids: torch.Tensor, pending: tuple[list[int], list[int]], sampled: SampledTokens | None
) -> None:
    """Write the previous step's sampled tokens into ids (on the device) at their positions."""
    positions, rows = pending
    if positions:
        positions, rows = to_device((host_tensor(positions), host_tensor(rows)), ids.device)
        ids[positions] = sampled.tokens[rows]


@dataclass
class FlatInputs:
    """A step's inputs as host lists: every item's tokens back to back (or, padded, each in q
    rows), their positions and KV slots, and per item its seq_len, query length and table."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    query_lens: list[int]
    tables: list[list[int]]


def flat_inputs(
    items: list[ForwardItem],
    tables: dict[Request, list[int]],
    block_size: int,
    q: int | None = None,
    num_reqs: int | None = None,
) -> FlatInputs:
    """The items' inputs back to back; with q (CUDA graphs' static shapes) each item padded to
    q tokens and the batch to num_reqs items. A padding token is id 0 at position 0 that stores
    no KV (slot -1); a request's seq_len counts its padding tokens, so its real queries keep
    their positions (query j sits at seq_len - q + j) and causal masking hides the padding keys
    from them; a padding request has q keys in the null block."""
    num_reqs = num_reqs or len(items)
    size = num_reqs * q if q else sum(len(it.token_ids) for it in items)
    out = FlatInputs([0] * size, [0] * size, [-1] * size, [q or 0] * num_reqs, [], [])
    offset = 0
    for b, item in enumerate(items):
        table = tables[item.request]
        n, start = len(item.token_ids), item.start
        base = b * q if q else offset
        out.input_ids[base : base + n] = item.token_ids
        out.positions[base : base + n] = range(start, start + n)
        out.slots[base : base + n] = slot_ids(table, start, n, block_size)
        out.seq_lens[b] = start + (q or n)
        out.query_lens.append(n)
        out.tables.append(table)
        offset += n
    return out


def real_rows(query_lens: list[int], q: int | None = None) -> list[int]:
    """The rows that hold real tokens: every row back to back, or with q (padded, as
    flat_inputs lays them out) the first query_lens[b] of request b's q rows."""
    if q is None:
        return list(range(sum(query_lens)))
    return [b * q + j for b, n in enumerate(query_lens) for j in range(n)]
