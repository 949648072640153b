"""KVCacheManager: prefix hits, copy-on-write forks, capacity with cached free blocks."""

from __future__ import annotations

from blocks import make_request

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

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
