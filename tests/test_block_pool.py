"""Block pool unit tests, and a stateful model of KVCacheManager + Scheduler (CPU, no model).

The state machine plays the engine: it schedules, "runs" each step by writing into a shadow KV
store what the model runner would write (CoW copies first, then one entry per computed slot),
then updates the requests as the engine does. After every rule it checks the pool's bookkeeping
and that every computed position of every live request reads back its own prefix's KV.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.block_pool import NULL_BLOCK, BlockPool, hash_block
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def make_request(request_id: str, tokens: list[int], block_size: int, salt: bytes = b"") -> Request:
    params = SamplingParams(max_tokens=None)
    return Request(request_id, list(tokens), params, set(), 10_000, 0, salt, block_size)


def chain(token_ids: list[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        hashes.append(parent)
    return hashes


# ---- BlockPool -----------------------------------------------------------------------------


def test_null_block_is_never_allocated():
    pool = BlockPool(5)
    assert pool.num_usable == pool.num_free == 4
    blocks = pool.allocate(4)
    assert sorted(blocks) == [1, 2, 3, 4] and NULL_BLOCK not in blocks
    assert pool.num_free == 0 and pool.ref_counts[NULL_BLOCK] == 0
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.free(blocks)
    assert NULL_BLOCK not in pool.free_queue
    with pytest.raises(MemoryError):
        pool.allocate(5)  # the null block does not count as capacity


def test_too_small_pool_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_allocate_touch_free_ref_counts():
    pool = BlockPool(6)
    a, b = pool.allocate(2)
    assert pool.ref_counts[a] == pool.ref_counts[b] == 1
    pool.touch([a, b])
    pool.touch([a])
    assert (pool.ref_counts[a], pool.ref_counts[b]) == (3, 2)
    pool.free([a, b])
    assert (pool.ref_counts[a], pool.ref_counts[b]) == (2, 1)
    assert a not in pool.free_queue and b not in pool.free_queue
    pool.free([a, b])
    assert pool.ref_counts[b] == 0 and b in pool.free_queue and a not in pool.free_queue
    pool.free([a])
    assert pool.num_free == pool.num_usable


def test_touch_takes_a_free_block_out_of_the_queue():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.free([a])
    assert a in pool.free_queue
    pool.touch([a])
    assert a not in pool.free_queue and pool.ref_counts[a] == 1
    assert a not in pool.allocate(2)


def test_double_free_asserts():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([a])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([2])  # never allocated


def test_free_queue_is_lru_and_a_request_tail_goes_first():
    pool = BlockPool(8)
    first = pool.allocate(3)
    second = pool.allocate(3)
    assert first == [1, 2, 3] and second == [4, 5, 6]
    pool.free(first)
    pool.free(second)
    # The never-used block 7 first, then each request tail-first, in the order freed.
    assert list(pool.free_queue) == [7, 3, 2, 1, 6, 5, 4]
    assert pool.allocate(7) == [7, 3, 2, 1, 6, 5, 4]


def test_cached_block_reused_until_evicted():
    pool = BlockPool(4)
    h = hash_block(None, [1, 2, 3, 4])
    (a,) = pool.allocate(1)
    pool.cache_block(a, h)
    assert pool.lookup(h) == a and pool.block_hashes[a] == h
    pool.free([a])
    assert pool.lookup(h) == a and pool.num_cached_free == 1  # free, yet still a hit
    pool.touch([a])  # a prefix hit revives it
    assert pool.ref_counts[a] == 1 and pool.num_free == 2
    pool.free([a])
    got = pool.allocate(2)  # the two never-used blocks go before the cached one
    assert a not in got and pool.lookup(h) == a and pool.num_evictions == 0
    assert pool.allocate(1) == [a]  # allocation pressure reaches it: evicted
    assert pool.lookup(h) is None and pool.block_hashes[a] is None
    assert pool.num_evictions == 1


def test_cache_block_first_holder_wins():
    pool = BlockPool(4)
    h = hash_block(None, [7] * 4)
    a, b = pool.allocate(2)
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.lookup(h) == a and pool.block_hashes[b] is None
    pool.cache_block(a, hash_block(None, [8] * 4))  # a block keeps its first hash
    assert pool.block_hashes[a] == h and len(pool.cached) == 1
    # Evicting the loser must not drop the winner's entry.
    pool.free([b])
    pool.allocate(2)
    assert pool.lookup(h) == a


def test_caching_disabled_and_reset():
    off = BlockPool(3, enable_caching=False)
    (a,) = off.allocate(1)
    off.cache_block(a, b"h")
    assert off.lookup(b"h") is None and off.block_hashes[a] is None

    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"x")
    pool.cache_block(b, b"y")
    pool.free([a])
    pool.reset_prefix_cache()  # only free blocks lose their hashes
    assert pool.lookup(b"x") is None and pool.lookup(b"y") == b
    assert pool.num_evictions == 1


def test_hash_block_chains_tokens_and_extra_keys():
    h1 = hash_block(None, [1, 2])
    assert h1 == hash_block(None, [1, 2]) and len(h1) == 32
    assert h1 != hash_block(None, [2, 1])
    assert h1 != hash_block(None, [1, 2], b"salt")
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(None, [9, 2]), [3, 4])
    req = make_request("r", list(range(11)), 4, b"salt")
    assert req.full_block_hashes() == chain(list(range(11)), 4, b"salt")
    assert len(req.block_hashes) == 2
    req.append_token(11)
    assert req.full_block_hashes() == chain(list(range(12)), 4, b"salt")


# ---- KVCacheManager ------------------------------------------------------------------------


def test_prefix_hit_leaves_the_last_token_to_compute():
    kv = KVCacheManager(10, 4, True)
    a = make_request("a", list(range(12)), 4)
    assert kv.allocate(a, 12) == (True, None)
    a.num_computed_tokens = 12
    kv.cache_blocks(a)
    table_a = list(kv.block_tables.get(a, []))
    kv.free(a)
    b = make_request("b", list(range(12)), 4)
    assert kv.find_prefix(b) == table_a[:2]  # block 3 holds the last token: recomputed
    c = make_request("c", list(range(13)), 4)
    assert kv.find_prefix(c) == table_a
    salted = make_request("s", list(range(13)), 4, b"x")
    assert kv.find_prefix(salted) == []
    prompt_lps = Request("p", list(range(13)), SamplingParams(prompt_logprobs=1), set(), 99)
    assert kv.find_prefix(prompt_lps) == []


def test_fork_shares_then_copies_on_write():
    kv = KVCacheManager(8, 4, True)
    parent = make_request("p", list(range(6)), 4)
    assert kv.allocate(parent, 6) == (True, None)
    parent.num_computed_tokens = 6
    child = make_request("c", list(range(6)), 4)
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    x, y = kv.block_tables[parent]
    assert kv.block_tables[child] == [x, y] and kv.pool.ref_counts[x] == kv.pool.ref_counts[y] == 2
    child.append_token(100)
    ok, copy = kv.allocate(child, 1)
    assert ok and copy is not None and copy[0] == y
    # The source stays held until the step's copies have run (a sharer preempted in the same
    # schedule cannot hand it to someone else before it is read).
    assert kv.block_tables.get(child, []) == [x, copy[1]] and kv.pool.ref_counts[y] == 2
    kv.release_copy_sources()
    assert kv.pool.ref_counts[y] == 1
    parent.append_token(200)
    assert kv.allocate(parent, 1) == (True, None)  # sole owner now: written in place
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free == kv.pool.num_usable


def test_allocate_counts_free_prefix_hits_against_capacity():
    kv = KVCacheManager(4, 4, True)  # 3 usable blocks
    a = make_request("a", list(range(8)), 4)
    kv.allocate(a, 8)
    a.num_computed_tokens = 8
    kv.cache_blocks(a)
    kv.free(a)
    # Both cached blocks are free; hitting them leaves 1 block, and 16 tokens need 2 more.
    b = make_request("b", list(range(8)) + [0] * 8, 4)
    prefix = kv.find_prefix(b)
    assert len(prefix) == 2
    assert kv.allocate(b, 8, prefix) == (False, None)
    assert kv.pool.num_free == 3 and kv.pool.lookup(b.full_block_hashes()[0]) is not None
    assert kv.allocate(b, 4, prefix) == (True, None)
    assert kv.pool.num_free == 0


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
    )
    def setup(self, block_size, num_blocks, max_num_batched_tokens, max_num_seqs):
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks, block_size, True)
        self.pool = self.kv.pool
        self.sched = Scheduler(self.kv, max_num_seqs, max_num_batched_tokens)
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
