"""What a step feeds the model: each request's tokens, and under async scheduling the tokens
the step in flight sampled, which reach the inputs on the device before they reach the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

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
