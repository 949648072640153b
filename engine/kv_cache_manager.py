"""Per-request block tables over the block pool: prefix hits, on-demand growth, fork, free."""

from __future__ import annotations

from engine.block_pool import BlockPool
from engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.block_tables: dict[Request, list[int]] = {}
        self.num_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0
        self.copy_sources: list[int] = []  # CoW sources of this step, held until copied
        self.uncomputed: list[int] = []  # registered in the prefix cache before this step runs
        # Leading blocks of each request's table already offered to the prefix cache: each step
        # registers only the blocks after them (not the whole table again).
        self.num_offered: dict[Request, int] = {}
        # Leading blocks of each request's table flagged as holding draft KV (the same idea).
        self.num_draft_marked: dict[Request, int] = {}

    def release_copy_sources(self) -> None:
        """The step's copy-on-write copies have run: drop the references their sources held."""
        self.pool.free(self.copy_sources)
        self.copy_sources = []

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, request: Request) -> list[int]:
        """Longest run of cached full blocks. The last token is always left to compute, since
        its logits are needed: only blocks within the first num_tokens - 1 tokens count."""
        if not self.pool.enable_caching or request.params.prompt_logprobs is not None:
            return []
        hashes = request.full_block_hashes()
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        self.num_query_tokens += request.num_tokens
        self.num_hit_tokens += num_hit_tokens

    def allocate(
        self, request: Request, num_new_tokens: int, prefix_blocks: list[int] | None = None
    ) -> tuple[bool, tuple[int, int] | None]:
        """Make room for num_new_tokens more computed tokens. Returns (ok, copy): copy is a
        (src, dst) block pair when the request's last, partly filled block was shared (n > 1
        fork) and must be copied before it is written (copy-on-write)."""
        table = self.block_tables.get(request, [])
        prefix_blocks = prefix_blocks or []
        num_computed = request.num_computed_tokens + len(prefix_blocks) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = needed - len(table) - len(prefix_blocks)
        cow = num_computed % self.block_size != 0 and self.pool.ref_counts[table[-1]] > 1
        # Prefix hits that sit in the free queue stop being free once touched.
        num_free_hits = sum(1 for b in prefix_blocks if self.pool.ref_counts[b] == 0)
        if num_new_blocks + cow > self.pool.num_free - num_free_hits:
            return False, None
        self.block_tables[request] = table
        self.pool.touch(prefix_blocks)
        table.extend(prefix_blocks)
        copy = None
        if cow:
            new_block = self.pool.allocate(1)[0]
            copy = (table[-1], new_block)
            # The source keeps this request's reference until the copy has run: a sharer
            # preempted later in the same schedule must not free it for reuse before then.
            self.copy_sources.append(table[-1])
            table[-1] = new_block
        if num_new_blocks > 0:
            table.extend(self.pool.allocate(num_new_blocks))
        return True, copy

    def cache_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Register the request's full blocks within its first num_tokens tokens (default: its
        computed ones) in the prefix cache. The scheduler registers the blocks a step is about
        to compute when it allocates them, so that a request admitted later in the same step
        shares them: each layer stores the whole batch's K/V before any attention reads it.
        A block is offered once: one whose tokens another block holds already stays private."""
        if not self.pool.enable_caching:
            return
        table = self.block_tables.get(request, [])
        if num_tokens is None:
            num_tokens = request.num_computed_tokens
        first = self.num_offered.get(request, 0)
        end = min(num_tokens // self.block_size, len(table))
        if end <= first:
            return
        hashes = request.full_block_hashes()
        end = min(end, len(hashes))
        # Blocks past those whose K/V has landed are filled by a step queued or in flight.
        landed = max(0, request.num_computed_tokens - request.num_inflight_tokens)
        num_computed_blocks = landed // self.block_size
        for i in range(first, end):
            block = table[i]
            if self.pool.block_hashes[block] is not None:
                continue
            self.pool.cache_block(block, hashes[i])
            if i >= num_computed_blocks and self.pool.block_hashes[block] is not None:
                self.uncomputed.append(block)
        self.num_offered[request] = max(first, end)

    def step_launched(self) -> list[int]:
        """The step is queued: the blocks registered ahead of it hold their K/V once it lands
        (anything reading them runs after it). Returns them, to forget if it never lands."""
        blocks, self.uncomputed = self.uncomputed, []
        return blocks

    def forget_uncomputed(self, blocks: list[int] | None = None) -> None:
        """A step failed: the blocks registered ahead of it (these, or the current schedule's)
        hold no K/V; unregister them."""
        self.pool.uncache(self.uncomputed if blocks is None else blocks)
        if blocks is None:
            self.uncomputed = []

    def uncache(self, request: Request) -> None:
        """Drop every block of the request's table from the prefix cache: its K/V is not to be
        trusted (the model's logits for it were NaN). Prefix hits it took from other requests go
        too; they stay valid where they are held, only no longer findable."""
        self.pool.uncache(self.block_tables.get(request, []))

    def mark_draft_computed(self, request: Request) -> None:
        """Flag the request's full blocks within its draft-computed tokens as holding the draft
        model's KV too, so a prefix hit on them spares the draft its catch-up."""
        table = self.block_tables.get(request, [])
        end = min(request.num_draft_computed // self.block_size, len(table))
        for block in table[self.num_draft_marked.get(request, 0) : end]:
            self.pool.draft_ready[block] = True
        self.num_draft_marked[request] = max(end, self.num_draft_marked.get(request, 0))

    def num_draft_ready(self, blocks: list[int]) -> int:
        """Leading blocks of a prefix hit whose draft KV is valid."""
        ready = self.pool.draft_ready
        return next((i for i, b in enumerate(blocks) if not ready[b]), len(blocks))

    def trim(self, request: Request) -> None:
        """Free the blocks past the request's computed tokens (slots of rejected drafts)."""
        table = self.block_tables.get(request)
        if table is None:
            return
        keep = self.blocks_needed(request.num_computed_tokens)
        if len(table) > keep:
            self.pool.free(table[keep:])
            del table[keep:]
            for cursor in (self.num_offered, self.num_draft_marked):
                if cursor.get(request, 0) > keep:
                    cursor[request] = keep

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (copy-on-write on first append)."""
        table = self.block_tables[parent]
        self.pool.touch(table)
        self.block_tables[child] = list(table)
        self.num_offered[child] = self.num_offered.get(parent, 0)
        self.num_draft_marked[child] = self.num_draft_marked.get(parent, 0)

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request, None)
        self.num_offered.pop(request, None)
        self.num_draft_marked.pop(request, None)
        if table:
            self.pool.free(table)
