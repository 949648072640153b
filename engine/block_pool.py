"""Block pool: fixed-size KV blocks, reference counts, and the prefix-cache index.

Invariants:
- Block 0 is the null block: it pads block tables and is never allocated or freed.
- A block is in `free_queue` exactly when its reference count is 0, in allocation order:
  first the freed blocks that hold no cached prefix, most recently freed first; then the
  never-used ones; then those that hold a cached prefix, least recently freed first, so such a
  block stays reusable by hash until allocation pressure reaches it (the LRU eviction). Reusing
  a just-freed block before a never-used one keeps a server's cache in the pages it already
  has: a never-used block's first write faults in and zeroes fresh pages (on CPU, 2 MiB huge
  pages per layer and head), ~10% of a prefill step with prefix caching off, and the resident
  memory grows to the whole pool.
- `cached` maps a chained block hash to the one block that holds those tokens' KV.
- `draft_ready[b]`: block b is full and also holds the draft model's KV for its tokens (the
  draft runs only for requests that speculate, so it may lag); cleared when b is reallocated.
"""

from __future__ import annotations

import hashlib
import struct
import unicodedata
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from engine.errors import ParamError

NULL_BLOCK = 0
ROOT_HASH = b"tandem-prefix-root"


class BlockPoolError(RuntimeError):
    """The pool's reference counts were about to break (a bug upstream, not bad input): raised
    whatever Python's flags, unlike an assert."""


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    """Chained, process-stable block hash (sha256 over the parent hash, tokens, extra keys).
    The tokens and the extra keys each go in after their length, so no split of the same bytes
    between them hashes alike."""
    h = hashlib.sha256(parent or ROOT_HASH)
    h.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(struct.pack("<Q", len(extra_keys)))
    h.update(extra_keys)
    return h.digest()


def cache_extra_keys(
    cache_salt: str | None, adapter_key: bytes = b"", draft_key: bytes = b""
) -> bytes:
    """A request's extra keys: its cache salt, its adapter's cache key and its draft adapter's,
    each after its length. Without the lengths, a salt equal to an adapter's key would hash
    like that adapter's requests and read (or plant) their KV."""
    check_cache_salt(cache_salt)
    parts = ((cache_salt or "").encode(), adapter_key, draft_key)
    return b"".join(struct.pack("<Q", len(part)) + part for part in parts)


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, extra_keys: bytes = b""
) -> list[bytes]:
    """Append to `hashes` (the chain of the first len(hashes) blocks) the chained hash of every
    further full block of `token_ids`. The engine's requests and the replica router both hash
    through here, so a router's match is the cache's own key."""
    while (len(hashes) + 1) * block_size <= len(token_ids):
        i = len(hashes)
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens, extra_keys))
    return hashes


MAX_CACHE_SALT_CHARS = 1024  # hashed into every block of the request


def check_cache_salt(cache_salt: str | None) -> None:
    """A salt is printable text of bounded length: control characters are refused (a salt
    must not pass for any other part of a cache key, and must show plainly in logs)."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str):
        raise ParamError("cache_salt", f"cache_salt must be a string, got {cache_salt!r:.100}")
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        message = f"cache_salt is {len(cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}"
        raise ParamError("cache_salt", message)
    bad = next((c for c in cache_salt if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        message = f"cache_salt must not hold control characters, got {bad!r} in {cache_salt!r:.100}"
        raise ParamError("cache_salt", message)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.draft_ready = [False] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_free(self) -> int:
        """Free blocks still holding a cached prefix (reusable until evicted)."""
        return sum(1 for b in self.free_queue if self.block_hashes[b] is not None)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise MemoryError(f"asked for {n} blocks, {len(self.free_queue)} free")
        blocks = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            self.draft_ready[block] = False
            blocks.append(block)
        return blocks

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on blocks found by prefix lookup (or shared by a fork)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference each, the request's tail first to evict; a double free raises."""
        over = [b for b, n in Counter(blocks).items() if n > self.ref_counts[b]]
        if over:
            raise BlockPoolError(f"double free of blocks {over} (no reference left to drop)")
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                if self.block_hashes[block] is None:  # nothing to keep: reused first
                    self.free_queue.move_to_end(block, last=False)

    def cache_block(self, block: int, block_hash: bytes) -> None:
        """Register a full, computed block under its hash (first holder wins)."""
        if not self.enable_caching or self.block_hashes[block] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            self.block_hashes[block] = block_hash

    def uncache(self, blocks: Iterable[int]) -> None:
        """Drop blocks from the prefix-cache index: their K/V was never written."""
        for block in blocks:
            self._unindex(block)

    def _evict(self, block: int) -> None:
        if self._unindex(block):
            self.num_evictions += 1

    def _unindex(self, block: int) -> bool:
        block_hash = self.block_hashes[block]
        if block_hash is None:
            return False
        self.block_hashes[block] = None
        if self.cached.get(block_hash) == block:
            del self.cached[block_hash]
        return True

    def reset_prefix_cache(self) -> None:
        for block in self.free_queue:
            self._evict(block)
