"""A stateful model of Scheduler + KVCacheManager (CPU, no model).

The state machine plays the engine: it schedules, "runs" each step by writing into a shadow KV
store what the model runner would write (CoW copies first, then one entry per computed slot),
then updates the requests as the engine does. After every rule it checks the pool's bookkeeping
and that every computed position of every live request reads back its own prefix's KV.
"""

from __future__ import annotations

from blocks import make_request
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.block_pool import NULL_BLOCK
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.step_budget import StepBudget

# ---- KVCacheManager + Scheduler, stateful ----------------------------------------------------

BASES = [[1, 2, 3, 0] * 8, [3, 1, 2, 2, 0, 1] * 6]


def slot_keys(request: Request) -> list[int]:
    """One key per position standing for that position's KV: salt plus all tokens up to it."""
    keys, k = [], hash(request.cache_extra_keys)
    for t in request.token_ids:
        k = hash((k, t))
        keys.append(k)
    return keys


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([2, 4]),
        num_blocks=st.integers(6, 14),
        max_num_batched_tokens=st.sampled_from([3, 8, 64]),
        max_num_seqs=st.integers(2, 5),
        max_step_ms=st.sampled_from([None, 1.0, 6.0]),
    )
    def setup(self, block_size, num_blocks, max_num_batched_tokens, max_num_seqs, max_step_ms):
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks, block_size, True)
        self.pool = self.kv.pool
        budget = None
        if max_step_ms is not None:  # steps of 1 ms + 0.5 ms per token: 10 tokens in 6 ms
            budget = StepBudget(max_step_ms, min_chunk=block_size)
            for tokens in (2, 30):
                budget.observe(tokens, 0.001 + 0.0005 * tokens)
        self.sched = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens, None, budget)
        # Longest request: alone, it fits with one spare block for a copy-on-write.
        self.max_len = (num_blocks - 2) * block_size
        self.kv_slots: dict[int, list[int | None]] = {}  # block -> key per slot
        self.histories = [list(b) for b in BASES]
        self.num_requests = 0
        self.num_empty_steps = 0

    # -- helpers
    def live(self) -> list[Request]:
        return list(self.sched.running) + list(self.sched.waiting)

    def caught_up(self) -> list[Request]:
        return [r for r in self.sched.running if r.num_computed_tokens == r.num_tokens - 1]

    def add(self, tokens: list[int], salt: bytes) -> None:
        tokens = tokens[: self.max_len - 1] or [0]
        self.num_requests += 1
        req = make_request(f"r{self.num_requests}", tokens, self.bs, salt)
        self.sched.add(req)

    def retire(self, request: Request, status: RequestStatus) -> None:
        self.histories.append(list(request.token_ids))
        self.sched.finish(request, status)
        assert request.status == status and request not in self.kv.block_tables

    # -- rules
    @precondition(lambda self: len(self.live()) < 8)
    @rule(
        base=st.integers(0, 1),
        num_shared=st.integers(0, 24),
        tail=st.lists(st.integers(0, 3), max_size=10),
        salt=st.sampled_from([b"", b"", b"salt"]),
    )
    def add_request(self, base, num_shared, tail, salt):
        self.add(BASES[base][:num_shared] + tail, salt)

    @precondition(lambda self: len(self.live()) < 8)
    @rule(
        pick=st.integers(0, 999),
        cut=st.integers(1, 40),
        tail=st.lists(st.integers(0, 3), max_size=3),
    )
    def add_request_repeating_history(self, pick, cut, tail):
        """A prompt that replays a past request's tokens (prompt and output): a prefix hit."""
        history = self.histories[pick % len(self.histories)]
        self.add(history[:cut] + tail, b"")

    @rule(
        num_steps=st.integers(1, 4),
        new_tokens=st.lists(st.integers(0, 3), min_size=8, max_size=8),
    )
    def steps(self, num_steps, new_tokens):
        for i in range(num_steps):
            self.step(new_tokens[i:] + new_tokens[:i])

    def step(self, new_tokens: list[int]) -> None:
        waiting = set(self.sched.waiting)
        out = self.sched.schedule()
        assert out.total_tokens <= self.sched.max_num_batched_tokens
        assert len({id(r) for r in out.requests}) == len(out.requests)
        for r in out.preempted:
            assert r.status == RequestStatus.PREEMPTED and r not in out.requests
            assert r not in self.kv.block_tables and r.num_computed_tokens == 0
        if (self.sched.waiting or self.sched.running) and not out.requests:
            self.num_empty_steps += 1
            assert self.num_empty_steps < 2, "two schedules in a row did no work"
        else:
            self.num_empty_steps = 0
        self.run_model(out, waiting)
        self.kv.step_launched()
        for r, n in zip(out.requests, out.num_new_tokens, strict=True):
            r.num_computed_tokens += n
            self.kv.cache_blocks(r)
        for i, r in enumerate(out.requests):
            if r.num_computed_tokens == r.num_tokens:  # caught up: "sample" a token
                r.append_token(new_tokens[i % len(new_tokens)])
                if r.num_tokens >= self.max_len:
                    self.retire(r, RequestStatus.FINISHED_LENGTH)

    def run_model(self, out, admitted: set[Request]) -> None:
        """What the model runner writes: CoW copies first, then the KV of each new token."""
        for src, dst in out.block_copies:
            assert self.pool.ref_counts[src] >= 1 and self.pool.ref_counts[dst] == 1
            self.kv_slots[dst] = list(self.kv_slots[src])
        self.kv.release_copy_sources()
        for r, n in zip(out.requests, out.num_new_tokens, strict=True):
            assert n >= 1 and r.status == RequestStatus.RUNNING
            if r in admitted:  # starts at its prefix hit, which leaves >= 1 token to compute
                assert r.num_computed_tokens % self.bs == 0 and r.num_computed_tokens < r.num_tokens
                assert r.num_cached_tokens >= 0
            table, keys = self.kv.block_tables.get(r, []), slot_keys(r)
            assert len(table) == self.kv.blocks_needed(r.num_computed_tokens + n)
            for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                block = table[p // self.bs]
                # Shared only if registered ahead this step: its sharers were admitted after
                # and only read it (the same tokens' KV), later in the same forward.
                shared_ahead = block in self.kv.uncomputed
                assert self.pool.ref_counts[block] == 1 or shared_ahead, f"write into {block}"
                slots = self.kv_slots.setdefault(block, [None] * self.bs)
                slots[p % self.bs] = keys[p]

    @rule()
    def failed_step(self):
        """A step that raises before the model writes anything: its requests queue again with
        no blocks, and what was registered ahead of it leaves the prefix cache."""
        out = self.sched.schedule()
        ahead = list(self.kv.uncomputed)
        self.kv.release_copy_sources()
        self.sched.unschedule(out)
        assert not self.kv.uncomputed
        assert all(self.pool.block_hashes[b] is None for b in ahead)
        for r in out.requests:
            assert r in self.sched.waiting and not self.kv.block_tables.get(r, [])

    @precondition(lambda self: self.caught_up())
    @rule(pick=st.integers(0, 99), token=st.integers(0, 3))
    def fork(self, pick, token):
        """n > 1 style: a sibling shares every block, then diverges by one sampled token."""
        candidates = self.caught_up()
        parent = candidates[pick % len(candidates)]
        self.num_requests += 1
        child = make_request(
            f"r{self.num_requests}",
            parent.token_ids[: parent.num_computed_tokens],
            self.bs,
            parent.cache_extra_keys,
        )
        child.append_token(token)
        self.sched.fork(parent, child)

    @precondition(lambda self: self.sched.running)
    @rule(pick=st.integers(0, 99))
    def preempt(self, pick):
        request = self.sched.running[pick % len(self.sched.running)]
        self.sched.running.remove(request)
        self.sched.preempt(request)
        assert request not in self.kv.block_tables and self.sched.waiting[0] is request

    @precondition(lambda self: self.live())
    @rule(pick=st.integers(0, 99))
    def abort(self, pick):
        live = self.live()
        self.retire(live[pick % len(live)], RequestStatus.FINISHED_ABORTED)

    @precondition(lambda self: self.caught_up())
    @rule(pick=st.integers(0, 99))
    def finish(self, pick):
        candidates = self.caught_up()
        self.retire(candidates[pick % len(candidates)], RequestStatus.FINISHED_STOPPED)

    @rule()
    def reset_prefix_cache(self):
        self.pool.reset_prefix_cache()
        assert all(self.pool.block_hashes[b] is None for b in self.pool.free_queue)

    # -- invariants
    @invariant()
    def ref_counts_match_block_tables(self):
        pool = self.pool
        holders = [0] * pool.num_blocks
        for table in self.kv.block_tables.values():
            for block in table:
                assert block != NULL_BLOCK
                holders[block] += 1
        assert pool.ref_counts == holders
        free = set(pool.free_queue)
        assert len(free) == pool.num_free
        assert free == {b for b in range(1, pool.num_blocks) if pool.ref_counts[b] == 0}
        # Prefix-cache cursors: only for requests holding blocks, never past their tables.
        for request, num_offered in self.kv.num_offered.items():
            assert num_offered <= len(self.kv.block_tables[request])

    @invariant()
    def hash_index_is_consistent(self):
        pool = self.pool
        for block_hash, block in pool.cached.items():
            assert block != NULL_BLOCK and pool.block_hashes[block] == block_hash
        for block, block_hash in enumerate(pool.block_hashes):
            if block_hash is not None:
                assert pool.cached[block_hash] == block

    @invariant()
    def live_requests_read_their_own_kv(self):
        live = self.live()
        assert set(self.kv.block_tables) <= set(live)
        for r in self.sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0 and not self.kv.block_tables.get(r, [])
        for r in self.sched.running:
            assert r.status == RequestStatus.RUNNING
            table = self.kv.block_tables.get(r, [])
            assert len(table) == self.kv.blocks_needed(r.num_computed_tokens)
            keys = slot_keys(r)
            for p in range(r.num_computed_tokens):
                assert self.kv_slots[table[p // self.bs]][p % self.bs] == keys[p], (r, p)
            hashes = r.full_block_hashes()
            num_full = r.num_computed_tokens // self.bs
            for i, block in enumerate(table):
                expected = hashes[i] if i < num_full else None
                assert self.pool.block_hashes[block] in (None, expected)

    @invariant()
    def idle_pool_is_all_free(self):
        if not self.live():
            assert not self.kv.block_tables
            assert self.pool.num_free == self.pool.num_usable


KVCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_kv_cache_state_machine = KVCacheMachine.TestCase
