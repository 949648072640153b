"""Prometheus metrics: latency histograms observed as outputs stream out, and gauges and
counters read from the engine's snapshot at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.entrypoints.async_engine import AsyncEngine, OutputObserver
from engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120)

# Read from the snapshot on every scrape: (name after "tandem_", help, the value's keys).
_GAUGES = (
    ("num_requests_running", "Requests running", "num_running"),
    ("num_requests_waiting", "Requests waiting", "num_waiting"),
    (
        "kv_utilization_ratio",
        "Tokens stored / token slots allocated in used blocks",
        "kv_utilization",
    ),
    ("prefix_cache_hit_rate", "Hit tokens / query tokens", "prefix_cache.hit_rate"),
    ("grammar_matchers", "Grammar matchers live", "grammar.num_matchers"),
    (
        "generation_tokens_per_second",
        "Tokens generated per second over the last ~10 s",
        "tokens_per_second",
    ),
    ("spec_acceptance_rate", "Accepted / drafted tokens", "speculation.acceptance_rate"),
    (
        "spec_mean_accepted_length",
        "Tokens emitted per verification step",
        "speculation.mean_accepted_length",
    ),
)
_COUNTERS = (
    ("prefix_cache_queries", "Prompt tokens looked up", "prefix_cache.query_tokens"),
    ("prefix_cache_hits", "Prompt tokens found cached", "prefix_cache.hit_tokens"),
    ("num_preemptions", "Requests preempted", "num_preemptions"),
    (
        "request_errors",
        "Requests ended by a failure in their own processing (finish_reason error)",
        "num_request_errors",
    ),
    ("generation_tokens", "Tokens generated", "num_generated_tokens"),
)


class ServerMetrics(OutputObserver):
    def __init__(self):
        self.registry = CollectorRegistry()

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.ttft = latency(
            "tandem_time_to_first_token_seconds", "Arrival to first generated token"
        )
        self.itl = latency(
            "tandem_inter_token_latency_seconds",
            "Time per output token after the first (a step that emits k tokens counts k times)",
        )
        self.e2e = latency("tandem_e2e_request_latency_seconds", "Arrival to finish")
        self.finished = Counter(
            "tandem_completions_finished",
            "Finished completions (n per request)",
            ["finish_reason"],
            registry=self.registry,
        )
        self._last: dict[str, tuple[float, int]] = {}  # request id -> (time, tokens) last seen

    def on_output(self, out: RequestOutput, now: float) -> None:
        new = sum(len(c.token_ids) for c in out.outputs)  # outputs are deltas (AsyncEngine)
        last = self._last.get(out.request_id)
        if last is None and new and out.metrics and out.metrics.first_token_time is not None:
            self.ttft.observe(max(0.0, out.metrics.first_token_time - out.metrics.arrival_time))
        elif last is not None and new:
            per_token = (now - last[0]) / new
            for _ in range(new):
                self.itl.observe(per_token)
        if new:
            self._last[out.request_id] = (now, (last[1] if last else 0) + new)
        if out.finished:
            self._last.pop(out.request_id, None)
            if out.metrics is not None and out.metrics.finished_time is not None:
                self.e2e.observe(out.metrics.finished_time - out.metrics.arrival_time)
            for c in out.outputs:
                self.finished.labels(c.finish_reason or "unknown").inc()

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def watch(self, engine: AsyncEngine) -> None:
        """Read the engine's state on every scrape."""
        self.registry.register(_EngineCollector(engine))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """One engine's gauges and counters; with replicas (Replicas.summaries), each sample
    labelled by replica plus replica="all": additive ones summed, the hit rate and KV usage
    recomputed from the sums."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        snaps = self.engine.summaries()  # {"": summary} for one engine
        families: dict[str, tuple] = {}  # name -> (family class, doc, label names, samples)
        for replica, snap in snaps.items():
            for family, name, doc, labels, value in _samples(snap):
                names = ["replica", *labels] if replica else list(labels)
                samples = families.setdefault(name, (family, doc, names, []))[3]
                if value is not None:
                    samples.append(({"replica": replica, **labels} if replica else labels, value))
        if any(snaps):
            _add_totals(families, snaps)
        for name, (family, doc, names, samples) in families.items():
            metric = family(f"tandem_{name}", doc, labels=names)
            for labels, value in samples:
                metric.add_metric(list(labels.values()), value)
            yield metric


# Summed over replicas as replica="all" (ratios are recomputed, not summed).
_ADDITIVE = {name for name, _, _ in _COUNTERS} | {
    "num_requests_running",
    "num_requests_waiting",
    "grammar_matchers",
    "generation_tokens_per_second",
    "kv_blocks",
    "spec_draft_tokens",
    "spec_accepted_tokens",
}


def _samples(snap: dict):
    """(family class, name, doc, labels, value) of every sample one engine summary gives."""
    for family, table in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
        for name, doc, keys in table:
            value = snap
            for key in keys.split("."):
                value = value[key]
            yield family, name, doc, {}, value
    total, used = snap["num_blocks"], snap["num_used_blocks"]
    doc = "Fraction of KV blocks held by requests"
    yield GaugeMetricFamily, "kv_cache_usage_ratio", doc, {}, used / total if total else 0.0
    cached = snap["num_cached_free_blocks"]
    free = snap["num_free_blocks"] - cached
    for state, n in {"used": used, "cached": cached, "free": free}.items():
        yield GaugeMetricFamily, "kv_blocks", "KV blocks by state", {"state": state}, n
    spec = snap["speculation"]
    for name, verb, key in (
        ("draft", "verified", "drafted_at"),
        ("accepted", "accepted", "accepted_at"),
    ):
        doc = f"Draft tokens {verb}, by draft position"
        yield CounterMetricFamily, f"spec_{name}_tokens", doc, {"position": ""}, None  # declared
        for position, n in enumerate(spec[key]):
            labels = {"position": str(position)}
            yield CounterMetricFamily, f"spec_{name}_tokens", doc, labels, n


def _add_totals(families: dict[str, tuple], snaps: dict[str, dict]) -> None:
    for name in _ADDITIVE & families.keys():
        totals: dict[tuple, float] = {}
        for labels, value in families[name][3]:
            rest = tuple((k, v) for k, v in labels.items() if k != "replica")
            totals[rest] = totals.get(rest, 0) + value
        families[name][3].extend(({"replica": "all", **dict(k)}, v) for k, v in totals.items())
    queries = sum(s["prefix_cache"]["query_tokens"] for s in snaps.values())
    hits = sum(s["prefix_cache"]["hit_tokens"] for s in snaps.values())
    blocks = sum(s["num_blocks"] for s in snaps.values())
    used = sum(s["num_used_blocks"] for s in snaps.values())
    for name, value in (
        ("prefix_cache_hit_rate", hits / queries if queries else 0.0),
        ("kv_cache_usage_ratio", used / blocks if blocks else 0.0),
    ):
        families[name][3].append(({"replica": "all"}, value))
