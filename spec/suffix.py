"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024; Arctic Inference, vLLM's "suffix"):
drafts from every earlier occurrence of the request's last tokens in its own prompt and output
and in its tenant's recent text, scored by how often each continuation followed.

What is searched, per request:
- its own tokens (prompt and output so far: in an agent loop the whole conversation, resent
  each turn), scanned like the n-gram proposer's;
- its tenant's text (`TenantText`): every finished request's prompt and output, kept per tenant
  (the request's salt: its cache_salt or API key's, the adapters' keys; the boundary prefix
  caching already keeps) in one append-only arena indexed by bigram. One tenant never drafts
  from another's text. A prompt that repeats a stored one (the next turn of a session) stores
  only its new part (chained hashes of 16-token blocks find it), and while it runs, the stored
  copies of its own prompt are left out of its counts (its own copy is searched already).
All tenants together keep at most `max_cached_tokens` tokens: the oldest stored text goes first.

Drafting (as Arctic's SuffixTree::speculate over a path): for each match length L (the
occurrences whose preceding L tokens equal the request's last L, L <= max_tree_depth), walk
forward from the set of occurrences, taking at each position the token most of them continue
with; the draft's probability is the product of those shares (count / occurrences still in
the set, the ones that end there included), the walk stops below min_token_prob or at
min(k, L * max_spec_factor + max_spec_offset) tokens. Of the drafts for every L, the one with
the highest score (the sum of its probabilities: its expected accepted length) wins, the longer
match on a tie. A suffix tree answers the same counts; scanning the occurrences of the last
bigram does it with a flat arena and no per-node objects (bench/RESULTS.md measures the cost).
"""

from __future__ import annotations

import bisect
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from engine.request import Request
from engine.scheduler import SchedulerOutput
from spec.draft_model import DraftModelProposer
from spec.proposer import drafts_wanted

HASH_BLOCK = 16  # tokens per hashed block (finding a stored prompt's repeat)
MAX_CANDIDATES = 128  # most recent occurrences of the last bigram looked at, per source
END = -1  # separates documents in the arena; never a token
# With a draft model: a suffix draft expected to land at least this many tokens stands alone
# (no draft pass for its request); below it the draft model drafts instead.
MIN_SCORE = 1.0


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # [j]: estimated P(drafts 0..j all hold)
    match_len: int = 0

    @property
    def score(self) -> float:
        return sum(self.probs)


class TenantText:
    """One tenant's stored text: documents in an append-only arena (END between them), a bigram
    index of absolute positions, and chained block hashes of what is stored. Positions are
    absolute (never reused); arena[i - base] is position i; positions below `start` are gone."""

    def __init__(self):
        self.arena = np.full(1024, END, dtype=np.int64)  # [capacity]
        self.base = 0  # absolute position of arena[0]
        self.start = 0  # first live absolute position
        self.end = 0  # next free absolute position
        self.index: dict[tuple[int, int], array] = {}  # (a, b) -> positions p: text[p-2:p] == a b
        self.blocks: OrderedDict[int, int] = OrderedDict()  # block hash -> its absolute start

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def append(self, token_ids: list[int], hashes: list[tuple[int, int]]) -> None:
        """Store a document (then END); hashes: (block hash, offset of the block in it)."""
        n = len(token_ids) + 1
        if self.end + n - self.base > len(self.arena):
            self._compact(self.end + n - self.start)
        at = self.end - self.base
        self.arena[at : at + n - 1] = token_ids
        self.arena[at + n - 1] = END
        for i in range(1, len(token_ids)):  # (the last one's continuation is END)
            key = (token_ids[i - 1], token_ids[i])
            positions = self.index.get(key)
            if positions is None:
                positions = self.index[key] = array("q")
            positions.append(self.end + i + 1)
        for h, offset in hashes:
            self.blocks[h] = self.end + offset
            self.blocks.move_to_end(h)
        self.end += n

    def evict_to(self, position: int) -> None:
        """Forget every position below `position` (the index lazily, compacting as it goes)."""
        old, self.start = self.start, max(self.start, position)
        self.arena[old - self.base : self.start - self.base] = END  # never matched again
        while self.blocks and next(iter(self.blocks.values())) < self.start:
            self.blocks.popitem(last=False)
        if self.start - self.base > len(self.arena) // 2:
            self._compact(self.end - self.start)

    def _compact(self, need: int) -> None:
        """Copy the live text to a fresh arena of room for `need` tokens, reindexed."""
        live = self.arena[self.start - self.base : self.end - self.base].copy()
        self.arena = np.full(max(1024, 2 * need), END, dtype=np.int64)
        self.arena[: len(live)] = live
        self.base = self.start
        tokens = live.tolist()
        self.index = {}
        for i in range(1, len(tokens)):
            if tokens[i - 1] != END and tokens[i] != END:
                key = (tokens[i - 1], tokens[i])
                positions = self.index.get(key)
                if positions is None:
                    positions = self.index[key] = array("q")
                positions.append(self.start + i + 1)

    def occurrences(self, a: int, b: int) -> np.ndarray:
        """Arena offsets just after the most recent live occurrences of the bigram a b."""
        positions = self.index.get((a, b))
        if not positions:
            return np.empty(0, dtype=np.int64)
        first = max(bisect.bisect_left(positions, self.start), len(positions) - MAX_CANDIDATES)
        return np.frombuffer(positions, dtype=np.int64)[first:] - self.base


class SuffixCache:
    """Every tenant's stored text, at most max_cached_tokens tokens in all (oldest out)."""

    def __init__(self, max_cached_tokens: int):
        self.max_cached_tokens = max_cached_tokens
        self.tenants: dict[bytes, TenantText] = {}
        self.order: deque[tuple[bytes, int, int]] = deque()  # (tenant, end position, tokens)
        self.num_tokens = 0

    def add(self, tenant: bytes, token_ids: list[int]) -> None:
        """Store a finished request's tokens, less the blocks the tenant already holds."""
        text = self.tenants.get(tenant)
        if text is None:
            text = self.tenants[tenant] = TenantText()
        hashes = block_hashes(token_ids)
        first_new = 0
        while first_new < len(hashes) and hashes[first_new] in text.blocks:
            first_new += 1
        # Keep a little context before the new part so that a match can run into it.
        start = max(0, first_new * HASH_BLOCK - HASH_BLOCK)
        if start + HASH_BLOCK >= len(token_ids) and first_new == len(hashes):
            start = max(0, len(token_ids) - 2 * HASH_BLOCK)  # only a short tail is new
        start = max(start, len(token_ids) - (self.max_cached_tokens - 1))  # (with its END)
        doc = token_ids[start:]
        new = [
            (h, j * HASH_BLOCK - start)
            for j, h in enumerate(hashes)
            if j >= first_new and j * HASH_BLOCK >= start
        ]
        text.append(doc, new)
        self.order.append((tenant, text.end, len(doc) + 1))
        self.num_tokens += len(doc) + 1
        while self.num_tokens > self.max_cached_tokens:
            old, end, n = self.order.popleft()
            self.num_tokens -= n
            self.tenants[old].evict_to(end)
            if self.tenants[old].num_tokens == 0:
                del self.tenants[old]


def block_hashes(token_ids: list[int]) -> list[int]:
    """Chained hashes of the full HASH_BLOCK-token blocks (each names its whole prefix)."""
    out, h = [], 0
    for i in range(0, len(token_ids) - HASH_BLOCK + 1, HASH_BLOCK):
        h = hash((h, *token_ids[i : i + HASH_BLOCK]))
        out.append(h)
    return out


@dataclass
class OwnText:
    """A running request's tokens as an array (grown as it decodes), and the arena ranges that
    store copies of its prompt's blocks (left out of its counts)."""

    tokens: np.ndarray  # [capacity]
    length: int
    skip_starts: np.ndarray  # [S] sorted arena offsets of HASH_BLOCK-token blocks to leave out

    def sync(self, token_ids: list[int]) -> None:
        n = len(token_ids)
        if n > len(self.tokens):
            grown = np.full(2 * n, END, dtype=np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : n] = token_ids[self.length :]
        self.length = n


class SuffixProposer:
    def __init__(
        self,
        max_tree_depth: int = 24,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        max_cached_tokens: int = 1 << 20,
        fallback: DraftModelProposer | None = None,
    ):
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor, self.max_spec_offset = max_spec_factor, max_spec_offset
        self.min_token_prob = min_token_prob
        self.cache = SuffixCache(max_cached_tokens)
        # Every request seen running (held until stored: a finished request leaves the engine
        # before the next step's propose stores it).
        self.own: dict[Request, OwnText] = {}
        # A draft model drafts for the requests whose suffix draft scores below MIN_SCORE.
        self.fallback = fallback

    def propose(self, sched: SchedulerOutput, tables: dict[Request, list[int]]) -> None:
        self.store_finished()
        for request in sched.requests:
            if request not in self.own:
                self.own[request] = self._own_text(request)
        confident = set()
        for request, drafts, k in drafts_wanted(sched):
            draft = self.draft(request, drafts, k)
            if self.fallback is None or draft.score >= MIN_SCORE:
                drafts += draft.token_ids
                confident.add(request)
        if self.fallback is not None:
            self.fallback.propose(sched, tables, skip=confident)

    def store_finished(self) -> None:
        """Finished requests' text goes to their tenant's store (seen at the next step)."""
        for request in [r for r in self.own if r.is_finished]:
            del self.own[request]
            self.cache.add(request.cache_extra_keys, request.token_ids)

    def _own_text(self, request: Request) -> OwnText:
        own = OwnText(np.full(2 * request.num_tokens + 64, END, dtype=np.int64), 0, np.empty(0))
        text = self.cache.tenants.get(request.cache_extra_keys)
        if text is not None:
            starts = []
            for h in block_hashes(request.prompt_token_ids):
                if h not in text.blocks:
                    break
                starts.append(text.blocks[h] - text.base)
            own.skip_starts = np.sort(np.asarray(starts, dtype=np.int64))
        return own

    def draft(self, request: Request, drafts: list[int], k: int) -> Draft:
        """The best-scoring draft of at most k tokens after request's tokens + drafts."""
        own = self.own.get(request)
        if own is None:
            own = self.own[request] = self._own_text(request)
        own.sync(request.token_ids)
        context = (request.token_ids[-self.max_tree_depth :] + drafts)[-self.max_tree_depth :]
        if len(context) < 2 or k <= 0:
            return Draft()
        ctx = np.asarray(context, dtype=np.int64)  # [D]
        n = own.length
        buf = own.tokens
        mine = np.flatnonzero((buf[: n - 2] == ctx[-2]) & (buf[1 : n - 1] == ctx[-1])) + 2
        sources = [(buf, mine[-MAX_CANDIDATES:][::-1])]
        text = self.cache.tenants.get(request.cache_extra_keys)
        if text is not None:
            theirs = text.occurrences(int(ctx[-2]), int(ctx[-1]))[::-1]
            if len(own.skip_starts) and len(theirs):
                at = np.searchsorted(own.skip_starts, theirs - 1, side="right") - 1
                inside = (at >= 0) & (theirs - 1 < own.skip_starts[at] + HASH_BLOCK)
                theirs = theirs[~inside]
            sources.append((text.arena, theirs))
        lengths, windows = [], []
        for arr, pos in sources:
            if len(pos):
                lengths.append(match_lengths(arr, pos, ctx))
                windows.append(continuations(arr, pos, k))
        if not lengths:
            return Draft()
        return self.best_draft(np.concatenate(lengths), np.concatenate(windows), k)

    def best_draft(self, lengths: np.ndarray, windows: np.ndarray, k: int) -> Draft:
        """lengths [C]: each occurrence's match length; windows [C, k]: the tokens after it
        (END past its end), in order of preference on ties (own text first, latest first)."""
        rows = windows.tolist()
        best = Draft()
        for match_len in sorted(set(lengths.tolist()), reverse=True):
            limit = int(match_len * self.max_spec_factor + self.max_spec_offset + 1e-6)
            chosen = [rows[i] for i in np.flatnonzero(lengths >= match_len)]
            draft = self._walk(chosen, min(k, limit))
            if draft.score > best.score:
                best, draft.match_len = draft, match_len
        return best

    def _walk(self, rows: list[list[int]], limit: int) -> Draft:
        draft, prob = Draft(), 1.0
        for j in range(limit):
            counts: dict[int, int] = {}
            for row in rows:
                if row[j] != END:
                    counts[row[j]] = counts.get(row[j], 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)  # the first of the most frequent
            prob *= counts[token] / len(rows)
            if prob < self.min_token_prob:
                break
            draft.token_ids.append(token)
            draft.probs.append(prob)
            rows = [row for row in rows if row[j] == token]
        return draft


def match_lengths(arr: np.ndarray, positions: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    """For each p in positions (arr[p-2:p] == ctx[-2:]), how many of ctx's last tokens
    arr[:p] ends with (END and the array's start end a match)."""
    lengths = np.full(len(positions), 2, dtype=np.int64)  # [C]
    alive = np.ones(len(positions), dtype=bool)
    for j in range(3, len(ctx) + 1):
        at = positions - j
        ok = alive & (at >= 0)
        ok[ok] = arr[at[ok]] == ctx[-j]
        alive = ok
        if not alive.any():
            break
        lengths += alive
    return lengths


def continuations(arr: np.ndarray, positions: np.ndarray, k: int) -> np.ndarray:
    """[C, k]: the k tokens from each position (END past the array, or after an END)."""
    at = positions[:, None] + np.arange(k)  # [C, k]
    out = np.where(at < len(arr), arr[np.minimum(at, len(arr) - 1)], END)
    ended = np.cumsum(out == END, axis=1) > 0
    out[ended] = END
    return out
