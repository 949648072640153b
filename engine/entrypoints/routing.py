"""Which engine replica serves a request (Ray Serve's RequestRouter, in the server's process).

Prefix-aware: a request goes to the replica whose prefix cache holds the longest prefix of its
prompt, so requests that share a system prompt or a conversation's history land where its KV
already is. What a replica holds is known from two sources, both keyed by the engine's own block
hashes (engine.block_pool.extend_block_hashes over the prompt, with the cache salt and the
adapter's cache key as extra keys, exactly as LLMEngine.add_request keys its blocks):
- every replica reports the hashes in its prefix-cache index (EngineReplica.
  record_routing_stats, every `request_routing_stats_period_s`);
- the router remembers the prompts it routed for `memory_s`, so the next request sharing a
  prefix follows the first before the replica's next report.
A replica is eligible only while its load (requests queued at it) is within `max_imbalance` of
the least loaded one: a hot prefix must not pile every request onto one replica. With no
eligible replica holding `min_blocks` of the prompt, the request goes to the least loaded
replica (then the one that took the fewest prompt blocks lately, then the one caching least,
so new prefixes spread), preferring (adapter affinity) those with the request's adapter loaded.
Load is counted here: requests this router sent to a replica and that have not finished.

`policy="round_robin"` is the baseline the benchmark and the tests compare against.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Set
from dataclasses import dataclass, field

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from engine.block_pool import cache_extra_keys, extend_block_hashes
from engine.sampling_params import SamplingParams
from lora.adapter import LoRARequest


@dataclass
class Submission:
    """One request as the server hands it to a replica (EngineReplica.generate)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    lora: LoRARequest | None = None
    cache_salt: str | None = None


@dataclass
class ReplicaView:
    """What the router knows of one replica."""

    key: str
    cached: Set[bytes] = frozenset()  # block hashes its last report listed (not copied)
    adapters: dict[str, bytes] = field(default_factory=dict)  # loaded: name -> cache key
    load: int = 0  # requests routed to it and not finished
    recent: Set[bytes] = frozenset()  # blocks of the prompts routed to it lately

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self.cached or block_hash in self.recent


def prompt_hashes(sub: Submission, block_size: int, adapter_key: bytes | None) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as the engine keys them (its salt is
    the cache salt then the adapter's cache key; LLMEngine.add_request)."""
    salt = cache_extra_keys(sub.cache_salt, adapter_key or b"")
    return extend_block_hashes([], sub.prompt, block_size, salt)


def matched_blocks(hashes: list[bytes], view: ReplicaView) -> int:
    """How many leading blocks of the prompt the replica holds (a chain: a miss ends it)."""
    for i, h in enumerate(hashes):
        if not view.holds(h):
            return i
    return len(hashes)


def rank(
    views: list[ReplicaView],
    sub: Submission,
    block_size: int,
    min_blocks: int = 1,
    max_imbalance: int = 4,
) -> tuple[list[list[str]], str]:
    """Replica keys, most preferred rank first, and why ("prefix", "adapter", "least_loaded").
    The first rank is the one replica chosen; the rest are where Ray Serve goes if its queue
    is full."""
    least = min(v.load for v in views)
    eligible = [v for v in views if v.load <= least + max_imbalance]
    name = sub.lora.name if sub.lora else None
    matches, hashed = {}, {}  # hashed: adapter cache key -> the prompt's hashes under it
    for v in eligible:
        if name is not None and name not in v.adapters:
            matches[v.key] = 0  # its cache cannot hold blocks keyed by that adapter
            continue
        key = v.adapters[name] if name else None
        if key not in hashed:
            hashed[key] = prompt_hashes(sub, block_size, key)
        matches[v.key] = matched_blocks(hashed[key], v)
    best = max(matches.values(), default=0)
    if best >= min_blocks:
        pool, why = [v for v in eligible if matches[v.key] == best], "prefix"
    else:
        # No replica holds enough: the least loaded, then the one that took the fewest prompt
        # blocks lately, then the one caching least (new prefixes spread over the replicas
        # instead of crowding the first), preferring (affinity) those with the adapter loaded.
        with_adapter = [v for v in eligible if name is not None and name in v.adapters]
        pool, why = (with_adapter, "adapter") if with_adapter else (eligible, "least_loaded")
    first = [min(pool, key=lambda v: (v.load, len(v.recent), len(v.cached))).key]
    rest = [v.key for v in views if v.key not in first]
    return ([first, rest] if rest else [first]), why


class ReplicaRouter(RequestRouter):
    """Ray Serve's hook: `choose_replicas` ranks candidates by `rank` (or round-robin)."""

    def initialize_state(
        self,
        block_size: int = 16,
        policy: str = "prefix",
        min_blocks: int = 1,
        max_imbalance: int = 4,
        memory_s: float = 10.0,
    ) -> None:
        if policy not in ("prefix", "round_robin"):
            raise ValueError(f"policy must be 'prefix' or 'round_robin', got {policy!r}")
        self.block_size, self.policy = block_size, policy
        self.min_blocks, self.max_imbalance, self.memory_s = min_blocks, max_imbalance, memory_s
        self.recent: dict[str, dict[bytes, float]] = {}  # replica -> hash -> when routed
        self.in_flight: Counter[str] = Counter()  # replica -> requests sent, not finished
        self._sent: dict[str, str] = {}  # internal request id -> replica
        self._turn = itertools.count()

    def view(self, replica: RunningReplica) -> ReplicaView:
        key = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        now = time.monotonic()
        recent = self.recent.setdefault(key, {})
        for h in [h for h, t in recent.items() if now - t > self.memory_s]:
            del recent[h]
        cached, adapters = stats.get("cached", frozenset()), stats.get("adapters", {})
        return ReplicaView(key, cached, adapters, self.in_flight[key], recent.keys())

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """One replica first (it is counted as the request's, its prompt blocks remembered
        there), the others after it. Ray Serve may call it again for the same request (a
        full queue, a replica gone): the request then counts where it was sent last."""
        sub = pending_request.args[0] if pending_request and pending_request.args else None
        by_key = {r.replica_id.unique_id: r for r in candidate_replicas}
        keys = sorted(by_key)
        if self.policy == "round_robin" or not isinstance(sub, Submission):
            turn = next(self._turn) % len(keys)
            ranks = [keys[turn : turn + 1], keys[:turn] + keys[turn + 1 :]]
        else:
            views = [self.view(by_key[k]) for k in keys]
            ranks, _ = rank(views, sub, self.block_size, self.min_blocks, self.max_imbalance)
        if pending_request is not None:
            self._sent_to(pending_request, by_key[ranks[0][0]], sub)
        return [[by_key[k] for k in keys] for keys in ranks if keys]

    def _sent_to(self, pending: PendingRequest, replica: RunningReplica, sub) -> None:
        """Count the request on `replica` and remember its prompt's blocks there (the replica
        will cache them; its report says so only a period later)."""
        key, request = replica.replica_id.unique_id, pending.metadata.internal_request_id
        previous = self._sent.get(request)
        if previous is not None:
            self.in_flight[previous] -= 1
        self._sent[request] = key
        self.in_flight[key] += 1
        if not isinstance(sub, Submission):
            return
        adapters = (replica.routing_stats or {}).get("adapters", {})
        adapter_key = adapters.get(sub.lora.name) if sub.lora else None
        if sub.lora and adapter_key is None:
            return  # the replica loads the adapter first: its version is not known here
        recent = self.recent.setdefault(key, {})
        now = time.monotonic()
        for h in prompt_hashes(sub, self.block_size, adapter_key):
            recent[h] = now

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        key = self._sent.pop(internal_request_id, None)
        if key is not None:
            self.in_flight[key] -= 1
