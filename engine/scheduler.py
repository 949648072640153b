"""Scheduler: one rule, no phases.

Every request has `num_tokens` (prompt + output) and `num_computed_tokens` (KV in the cache).
Each step gives each request up to `num_tokens - num_computed_tokens` new tokens within a
shared token budget: a prompt becomes a prefill (chunked when the budget runs short), a request
one token behind becomes a decode, and both mix in the same batch. Running requests go first,
in arrival order; when blocks run out the latest-arrived running request is preempted (its
blocks freed, recomputed later), and waiting requests are admitted strictly FCFS.

Under async scheduling the next step is scheduled while the current one runs: a request's
tokens sampled in flight (`num_pending`) count as tokens already, and a request whose last
allowed token is in flight is not scheduled again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import ParamError
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.step_budget import StepBudget


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # including draft slots
    num_drafts: list[int] = field(default_factory=list)  # draft slots reserved (speculation)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) CoW
    preempted: list[Request] = field(default_factory=list)
    # Filled once scheduled (spec.speculation.Speculation.propose), per request with draft
    # slots: its drafts (forced tokens first, then the proposer's; at most its slots), how many
    # of them are forced, and q [d, V] where a proposer sampled them (absent: one-hot).
    drafts: dict[Request, list[int]] = field(default_factory=dict)
    num_forced: dict[Request, int] = field(default_factory=dict)
    draft_probs: dict[Request, torch.Tensor] = field(default_factory=dict)
    # The draft slots are lookahead: the runner fills them with its own next greedy tokens
    # (several steps in one call), no drafts to verify.
    lookahead: bool = False

    def drafts_of(self, request: Request) -> list[int]:
        return self.drafts.get(request, [])

    def scheduled(self):
        """(request, tokens to compute including drafts, of which drafts) per request."""
        return zip(self.requests, self.num_new_tokens, self.num_drafts, strict=True)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int | None = None,
        step_budget: StepBudget | None = None,
    ):
        self.kv = kv
        self.step_budget = step_budget  # prompt tokens beside decodes (engine.step_budget)
        self.max_loras = max_loras  # distinct adapters in one step; None = no adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests left out of scheduling until released (a beam waiting for its round).
        self.held: set[Request] = set()
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self, wanted: dict[Request, int] | None = None) -> SchedulerOutput:
        """wanted: draft slots a decoding request asks for (spec.speculation's plan)."""
        out = SchedulerOutput()
        wanted = wanted or {}
        budget = self.max_num_batched_tokens
        prompt_left = budget if self.step_budget is None else self._prompt_tokens(wanted, budget)
        # Target and draft adapters in this step (ids); None: the engine has no adapters.
        loras = None if self.max_loras is None else (set(), set())
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request in self.held or (loras and not self._lora_fits(request, loras)):
                i += 1  # held, or its adapter has no slot this step (it runs when one is free)
                continue
            n = request.num_uncomputed  # 1: a decode; more: a prompt chunk, within prompt_left
            num_new = min(n, budget) if n == 1 else min(n, budget, prompt_left)
            last = request.num_output_tokens + request.num_pending >= request.max_output_tokens
            if last or num_new == 0:
                i += 1  # its last token is in flight (it finishes when that comes back), or no
                continue  # prompt tokens are left for its chunk
            k = wanted.get(request, 0)
            num_drafts = k and self._draft_slots(request, num_new, budget, k)
            if not self._allocate_or_preempt(request, num_new, num_drafts, out):
                break  # the request preempted itself: nothing after it can run either
            self.kv.cache_blocks(request, request.num_computed_tokens + num_new)
            if loras:
                self._take_loras(request, loras)
            budget -= out.num_new_tokens[-1]
            prompt_left -= num_new if n > 1 else 0
            i += 1
        while self.waiting and min(budget, prompt_left) > 0 and not out.preempted:
            request = next((r for r in self.waiting if r not in self.held), None)
            if request is None:
                break
            # A leader whose n > 1 siblings are not forked yet brings them along.
            seats = 1 + len(request.siblings)
            if len(self.running) + seats > self.max_num_seqs and self.running:
                self._make_way(out)
                break
            if (loras and not self._lora_fits(request, loras)) or request.num_inflight_tokens:
                break  # FCFS: nobody overtakes it (nor one requeued with a step in flight)
            prefix = self.kv.find_prefix(request) if request.num_computed_tokens == 0 else []
            num_cached = len(prefix) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached, budget, prompt_left)
            ok, copy = self.kv.allocate(request, num_new, prefix)
            if not ok:
                self._make_way(out)
                break
            self.waiting.remove(request)
            self.kv.record_lookup(request, num_cached)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            self.kv.cache_blocks(request, num_cached + num_new)  # shared from now on
            request.num_draft_computed = self.kv.num_draft_ready(prefix) * self.kv.block_size
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if loras:
                self._take_loras(request, loras)
            self._emit(out, request, num_new, 0, copy)
            budget -= num_new
            prompt_left -= num_new
        return out

    def _prompt_tokens(self, wanted: dict[Request, int], budget: int) -> int:
        """The step budget's prompt tokens beside this step's decode rows (drafts included)."""
        rows = sum(1 + wanted.get(r, 0) for r in self.running if r.is_decoding)
        return self.step_budget.prompt_tokens(rows, budget)

    def _last_held(self) -> Request | None:
        """The latest running request that is held (it gives way first under pressure)."""
        if not self.held:
            return None
        return next((r for r in reversed(self.running) if r in self.held), None)

    def _make_way(self, out: SchedulerOutput) -> None:
        """A waiting request found no seat or no blocks: a held request (which waits for it,
        e.g. a beam for the rest of its round) gives its own up, or the round never ends."""
        victim = self._last_held()
        if victim is not None:
            self._evict(victim, out)

    def _evict(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.preempt(victim)
        out.preempted.append(victim)

    def _lora_fits(self, request: Request, loras: tuple[set, set]) -> bool:
        """Its adapters (target's, draft's) are in this step already or still have a slot."""
        for adapter, taken in zip((request.lora, request.draft_lora), loras, strict=True):
            full = self.max_loras is None or len(taken) >= self.max_loras
            if adapter is not None and id(adapter) not in taken and full:
                return False
        return True

    @staticmethod
    def _take_loras(request: Request, loras: tuple[set, set]) -> None:
        for adapter, taken in zip((request.lora, request.draft_lora), loras, strict=True):
            if adapter is not None:
                taken.add(id(adapter))

    @staticmethod
    def _draft_slots(request: Request, num_new: int, budget: int, wanted: int) -> int:
        """Draft tokens to verify after a decode token: what the request wants, within the
        budget and never past what it may still emit (k drafts can yield k + 1 tokens)."""
        if num_new != 1 or not request.is_decoding:
            return 0
        room = request.max_output_tokens - request.num_output_tokens - 1
        return max(0, min(wanted, budget - 1, room))

    def _allocate_or_preempt(
        self, request: Request, num_new: int, num_drafts: int, out: SchedulerOutput
    ) -> bool:
        while True:
            ok, copy = self.kv.allocate(request, num_new + num_drafts)
            if not ok and num_drafts:
                num_drafts = 0  # drop speculation before preempting anyone
                continue
            if ok:
                self._emit(out, request, num_new + num_drafts, num_drafts, copy)
                return True
            victim = self._last_held() or self.running[-1]  # held requests give way first
            self._evict(victim, out)
            if victim is request:
                return False

    @staticmethod
    def _emit(out: SchedulerOutput, request: Request, num_new: int, num_drafts: int, copy) -> None:
        out.requests.append(request)
        out.num_new_tokens.append(num_new)
        out.num_drafts.append(num_drafts)
        if copy is not None:
            out.block_copies.append(copy)

    def unschedule(self, out: SchedulerOutput) -> None:
        """A step failed before its K/V was written: its requests drop their blocks and queue
        again (as if preempted), and blocks registered ahead of the step leave the prefix
        cache, so nothing that follows reads K/V that was never computed."""
        self.kv.forget_uncomputed()
        for request in reversed(out.requests):
            if request in self.running:
                self.running.remove(request)
                self.preempt(request)

    def preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.kv.free(request)
        request.num_computed_tokens = request.num_draft_computed = 0
        if request.grammar is not None:
            request.grammar.release()  # a re-admitted request replays its output
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def fork(self, leader: Request, child: Request) -> None:
        """An n > 1 sibling, once its leader's prompt is computed: it shares the leader's blocks
        (copy-on-write on first append), counts and place among the running requests."""
        self.kv.fork(leader, child)
        child.num_computed_tokens = leader.num_computed_tokens
        child.num_draft_computed = leader.num_draft_computed
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams, max_len: int) -> None:
        """ValueError unless a request could ever run: its prompt within the context limit
        (max_len) with room for one token, its n completions side by side, and every block it
        may need at once within the pool."""
        if num_prompt_tokens == 0:
            raise ParamError("prompt", "prompt must contain at least one token")
        if num_prompt_tokens >= max_len:
            raise ParamError(
                "prompt",
                f"prompt has {num_prompt_tokens} tokens, the context limit is {max_len} "
                "(and at least one token must be generated)",
            )
        if params.n > self.max_num_seqs:
            raise ParamError(
                "n",
                f"n={params.n} is over max_num_seqs={self.max_num_seqs}: the "
                "completions of one prompt run side by side",
            )
        total = min(num_prompt_tokens + (params.max_tokens or max_len), max_len)
        blocks = self.kv.blocks_needed
        need = blocks(num_prompt_tokens) + params.n * (blocks(total - num_prompt_tokens) + 1)
        if need > self.kv.pool.num_usable:
            raise ParamError(
                "max_tokens",
                f"max_tokens={params.max_tokens} and n={params.n} need up to {need} KV blocks "
                f"({total} tokens each) but the pool has {self.kv.pool.num_usable}; lower them "
                "or give the KV cache more memory",
            )

    def finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.has_invalid_kv:  # NaN logits: none of its blocks may serve a prefix hit
            self.kv.uncache(request)
        else:
            # Under async scheduling its last full block became hashable only with its last
            # token: offer it to the prefix cache now (nothing new otherwise).
            self.kv.cache_blocks(request)
        self.kv.free(request)
        if request.grammar is not None:
            request.grammar.release()
        request.status = status
