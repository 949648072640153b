"""Prometheus metrics: latency histograms observed as outputs stream out, and gauges and
counters read from the engine's snapshot at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.outputs import RequestOutput
from playground.async_engine import AsyncEngine, OutputObserver

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120)


class ServerMetrics(OutputObserver):
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=r)

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
            registry=r,
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
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        snap = self.engine.snapshot()
        yield _gauge("tandem_num_requests_running", "Requests running", snap["num_running"])
        yield _gauge("tandem_num_requests_waiting", "Requests waiting", snap["num_waiting"])
        total = snap["num_blocks"]
        yield _gauge(
            "tandem_kv_cache_usage_ratio",
            "Fraction of KV blocks held by requests",
            snap["num_used_blocks"] / total if total else 0.0,
        )
        blocks = GaugeMetricFamily("tandem_kv_blocks", "KV blocks by state", labels=["state"])
        cached = snap["num_cached_free_blocks"]
        blocks.add_metric(["used"], snap["num_used_blocks"])
        blocks.add_metric(["cached"], cached)
        blocks.add_metric(["free"], snap["num_free_blocks"] - cached)
        yield blocks
        yield _gauge(
            "tandem_kv_utilization_ratio",
            "Tokens stored / token slots allocated in used blocks",
            snap["kv_utilization"],
        )
        pc = snap["prefix_cache"]
        yield _counter("tandem_prefix_cache_queries", "Prompt tokens looked up", pc["query_tokens"])
        yield _counter("tandem_prefix_cache_hits", "Prompt tokens found cached", pc["hit_tokens"])
        yield _gauge("tandem_prefix_cache_hit_rate", "Hit tokens / query tokens", pc["hit_rate"])
        yield _counter("tandem_num_preemptions", "Requests preempted", snap["num_preemptions"])
        yield _counter(
            "tandem_request_errors",
            "Requests ended by a failure in their own processing (finish_reason error)",
            snap["num_request_errors"],
        )
        yield _gauge(
            "tandem_grammar_matchers", "Grammar matchers live", snap["grammar"]["num_matchers"]
        )
        yield _counter("tandem_generation_tokens", "Tokens generated", snap["num_generated_tokens"])
        yield _gauge(
            "tandem_generation_tokens_per_second",
            "Tokens generated per second over the last ~10 s",
            snap["tokens_per_second"],
        )
        spec = snap["speculation"]
        drafted = CounterMetricFamily(
            "tandem_spec_draft_tokens",
            "Draft tokens verified, by draft position",
            labels=["position"],
        )
        accepted = CounterMetricFamily(
            "tandem_spec_accepted_tokens",
            "Draft tokens accepted, by draft position",
            labels=["position"],
        )
        for j, (d, a) in enumerate(zip(spec["drafted_at"], spec["accepted_at"], strict=True)):
            drafted.add_metric([str(j)], d)
            accepted.add_metric([str(j)], a)
        yield drafted
        yield accepted
        yield _gauge(
            "tandem_spec_acceptance_rate", "Accepted / drafted tokens", spec["acceptance_rate"]
        )
        yield _gauge(
            "tandem_spec_mean_accepted_length",
            "Tokens emitted per verification step",
            spec["mean_accepted_length"],
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
