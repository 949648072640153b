"""BlockPool: ref counts, the free queue, prefix-cache hashes and eviction."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest
from blocks import chain, make_request

from engine.block_pool import (
    NULL_BLOCK,
    BlockPool,
    BlockPoolError,
    cache_extra_keys,
    hash_block,
)
from engine.errors import ParamError

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


def test_double_free_raises_and_changes_nothing():
    """A double free is a BlockPoolError (an assert would vanish under python -O), raised
    before any count moves: [b, a, a] with a held once leaves b held too."""
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(BlockPoolError, match=rf"double free of blocks \[{a}\]"):
        pool.free([a])
    with pytest.raises(BlockPoolError, match=r"double free of blocks \[3\]"):
        pool.free([3])  # never allocated
    pool.touch([a])
    with pytest.raises(BlockPoolError, match=rf"double free of blocks \[{a}\]"):
        pool.free([b, a, a])
    assert pool.ref_counts[a] == pool.ref_counts[b] == 1 and pool.num_free == 1


def test_double_free_raises_under_python_O():
    code = (
        "from engine.block_pool import BlockPool, BlockPoolError\n"
        "pool = BlockPool(4)\n"
        "try:\n    pool.free([1])\nexcept BlockPoolError as e:\n    print('raised', e)\n"
        "print('count', pool.ref_counts[1])\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True)
    assert out.stdout.split("\n")[:2] == [
        "raised double free of blocks [1] (no reference left to drop)",
        "count 0",
    ], out.stderr


def test_cached_free_blocks_are_lru_and_a_request_tail_goes_first():
    pool = BlockPool(8)
    first = pool.allocate(3)
    second = pool.allocate(3)
    assert first == [1, 2, 3] and second == [4, 5, 6]
    parent = None
    for block in first + second:
        parent = hash_block(parent, [block] * 4)
        pool.cache_block(block, parent)
    pool.free(first)
    pool.free(second)
    # The never-used block 7 first, then each request tail-first, in the order freed.
    assert list(pool.free_queue) == [7, 3, 2, 1, 6, 5, 4]
    assert pool.allocate(7) == [7, 3, 2, 1, 6, 5, 4]


def test_uncached_free_blocks_are_reused_before_never_used_ones():
    # Blocks that hold no cached prefix (prefix caching off, a request's partial tail) go to
    # the front, most recently freed first: their pages are already resident, a never-used
    # block's are faulted in and zeroed on its first write. Cached ones keep their LRU place.
    pool = BlockPool(8, enable_caching=True)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, hash_block(None, [1, 2, 3, 4]))
    pool.free([a, b])  # a cached, b not
    assert list(pool.free_queue) == [b, 4, 5, 6, 7, a]
    pool.free([c])
    assert pool.allocate(3) == [c, b, 4]
    assert pool.lookup(hash_block(None, [1, 2, 3, 4])) == a and pool.num_evictions == 0
    off = BlockPool(6, enable_caching=False)  # nothing is ever cached: a stack of freed blocks
    first = off.allocate(2)
    off.free(first)
    second = off.allocate(2)
    assert second == first and off.allocate(3) == [3, 4, 5]


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


def test_hash_components_are_length_prefixed():
    """The same bytes split another way between tokens and extra keys, or between a cache
    salt and an adapter's key, hash apart. Before, `cache_salt + adapter key` was one string:
    a base-model request salted with an adapter's key hashed like the adapter's requests (such
    a salt is refused now too; its extra keys are built here as the engine would)."""
    adapter_key = b"\x00lora:sql@v1"
    adapters = cache_extra_keys(None, adapter_key)
    planted = b"".join(struct.pack("<Q", len(p)) + p for p in (adapter_key, b"", b""))
    assert planted != adapters
    tokens = list(range(8))
    assert chain(tokens, 4, planted) != chain(tokens, 4, adapters)
    assert set(chain(tokens, 4, planted)).isdisjoint(chain(tokens, 4, adapters))
    assert cache_extra_keys("ab", b"c") != cache_extra_keys("a", b"bc")
    assert cache_extra_keys(None, b"", b"x") != cache_extra_keys(None, b"x", b"")
    assert hash_block(None, [1], b"\x02" + bytes(7)) != hash_block(None, [1, 2], b"")


@pytest.mark.parametrize("salt", ["\x00lora:sql@v1", "tenant\n", "a\x7fb", "\x85"])
def test_cache_salt_with_control_characters_is_refused(salt):
    with pytest.raises(ParamError, match="cache_salt must not hold control characters") as info:
        cache_extra_keys(salt)
    assert info.value.param == "cache_salt"


def test_cache_salt_length_boundary():
    cache_extra_keys("s" * 1024)
    with pytest.raises(ParamError, match="cache_salt is 1025 characters; at most 1024"):
        cache_extra_keys("s" * 1025)
