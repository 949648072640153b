"""Scheduler: one rule, no phases.

Every request has `num_tokens` (prompt + output) and `num_computed_tokens` (KV in the cache).
Each step gives each request up to `num_tokens - num_computed_tokens` new tokens within a
shared token budget: a prompt becomes a prefill (chunked when the budget runs short), a request
one token behind becomes a decode, and both mix in the same batch. Running requests go first,
in arrival order; when blocks run out the latest-arrived running request is preempted (its
blocks freed, recomputed later), and waiting requests are admitted strictly FCFS.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) CoW
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, out):
                break  # the request preempted itself: nothing after it can run either
            budget -= num_new
            i += 1
        while self.waiting and budget > 0 and not out.preempted:
            request = self.waiting[0]
            if len(self.running) + request.params.n > self.max_num_seqs and self.running:
                break
            prefix = self.kv.find_prefix(request) if request.num_computed_tokens == 0 else []
            num_cached = len(prefix) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            ok, copy = self.kv.allocate(request, num_new, prefix)
            if not ok:
                break
            self.waiting.popleft()
            self.kv.record_lookup(request, num_cached)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._emit(out, request, num_new, copy)
            budget -= num_new
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while True:
            ok, copy = self.kv.allocate(request, num_new)
            if ok:
                self._emit(out, request, num_new, copy)
                return True
            victim = self.running.pop()
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False

    @staticmethod
    def _emit(out: SchedulerOutput, request: Request, num_new: int, copy) -> None:
        out.requests.append(request)
        out.num_new_tokens.append(num_new)
        if copy is not None:
            out.block_copies.append(copy)

    def preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def add_running(self, request: Request) -> None:
        """A forked n > 1 sibling joins the running set directly."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)
