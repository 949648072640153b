"""Async scheduling's pipeline: at most one launched step not yet collected.

A step is launched (its work queued on the device), then collected (its tokens on the host,
appended). Under async scheduling the next step may be scheduled and launched in between, when
nothing that shapes it reads the tokens still in flight; it then computes the first of them from
the device's copy. The counts below keep the scheduler's view right meanwhile:
`Request.num_pending` (tokens sampled in flight, not yet in token_ids) and
`Request.num_inflight_tokens` (tokens counted computed whose K/V a launched step still writes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.request import Request, RequestStatus
from engine.scheduler import SchedulerOutput
from engine.step_results import LaunchedStep


@dataclass
class InFlight:
    """A launched step: what was scheduled, the runner's handle, when drafting (t0) and the
    target's launch (t1) began, whether the next step may be scheduled before it lands, and the
    blocks it fills that the prefix cache offers already."""

    sched: SchedulerOutput
    launched: LaunchedStep
    t0: float
    t1: float
    overlappable: bool
    uncomputed: list[int]  # blocks registered in the prefix cache ahead of it

    def count_launched(self) -> None:
        """Its scheduled tokens count as computed from now on (drafts once verified)."""
        for request, n, k in self.sched.scheduled():
            request.num_computed_tokens += n - k
            request.num_inflight_tokens += n - k
        for request in self.launched.members:
            request.num_pending += 1

    def count_landed(self) -> None:
        """Its K/V writes and sampled tokens are done (or will never be)."""
        for request, n, k in self.sched.scheduled():
            request.num_inflight_tokens -= n - k
        for request in self.launched.members:
            request.num_pending -= 1


class Pipeline:
    def __init__(self):
        self.in_flight: InFlight | None = None
        self.num_overlapped_steps = 0  # launched while the previous step was still in flight

    @property
    def must_land(self) -> bool:
        """A step is in flight whose tokens the next schedule needs on the host."""
        return self.in_flight is not None and not self.in_flight.overlappable

    def push(self, step: InFlight) -> InFlight | None:
        """step is now in flight; returns the one it overlapped, now to collect."""
        previous, self.in_flight = self.in_flight, step
        if previous is not None:
            self.num_overlapped_steps += 1
        return previous

    def take(self) -> InFlight | None:
        step, self.in_flight = self.in_flight, None
        return step


def may_overlap(members: list[Request], holds_back: Callable[[Request], bool]) -> bool:
    """Whether the next step may be scheduled before these requests' tokens reach the host:
    nothing that shapes their next step reads them (drafts or forced tokens, by holds_back;
    grammar masks, penalties, min_tokens bans, forking n > 1 siblings, a beam search that
    rewrites them: params.extra["lands_first"])."""
    return not any(
        r.grammar is not None
        or holds_back(r)
        or r.siblings
        or r.status == RequestStatus.FORK_PENDING
        or r.params.has_penalties
        or r.num_output_tokens < r.params.min_tokens
        or r.params.extra.get("lands_first", False)
        for r in members
    )
