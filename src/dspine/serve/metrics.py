"""Prometheus metrics of one server instance (own registry, so several apps can coexist)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LAT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """Counters, histograms and gauges exported at ``/metrics``.

    Names: ``dspine_requests_total{endpoint,outcome}`` (outcome: completed, cancelled,
    error, rejected, invalid), ``dspine_prompt_tokens_total``,
    ``dspine_generation_tokens_total``, ``dspine_acceptance_length`` (tokens emitted
    per request and cycle, bonus/correction included), ``dspine_cycle_seconds{phase}``
    (phase: draft, final, verify, total; one observation per batched cycle),
    ``dspine_batch_size``, ``dspine_time_to_first_token_seconds``,
    ``dspine_request_seconds``, gauges ``dspine_queue_depth``,
    ``dspine_running_requests``, ``dspine_free_slots``, ``dspine_cache_bytes{kind}``
    (kind: target_kv, draft_kv); with ``serve --ngram-cache-tokens`` also
    ``dspine_ngram_cache_{tokens,entries,tenants,bytes}`` and
    ``dspine_ngram_cache_{lookups,hits}_total`` (:meth:`add_output_cache`).
    """

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dspine_requests", "HTTP generation requests by outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("dspine_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("dspine_generation_tokens", "tokens generated", registry=r)
        self.acceptance = Histogram("dspine_acceptance_length",
                                    "tokens emitted per request per cycle (accepted + 1)",
                                    buckets=tuple(float(i) for i in range(1, 17)), registry=r)
        self.cycle = Histogram("dspine_cycle_seconds", "batched cycle time split by phase", ["phase"],
                               buckets=_TIME_BUCKETS, registry=r)
        self.batch_size = Histogram("dspine_batch_size", "running requests per cycle",
                                    buckets=tuple(float(i) for i in range(1, 9)), registry=r)
        self.ttft = Histogram("dspine_time_to_first_token_seconds", "submit to first token",
                              buckets=_LAT_BUCKETS, registry=r)
        self.latency = Histogram("dspine_request_seconds", "submit to finish", buckets=_LAT_BUCKETS, registry=r)
        self.queue_depth = Gauge("dspine_queue_depth", "requests waiting for a slot", registry=r)
        self.running = Gauge("dspine_running_requests", "requests in the running batch", registry=r)
        self.free_slots = Gauge("dspine_free_slots", "free running slots", registry=r)
        self.cache_bytes = Gauge("dspine_cache_bytes", "bytes held by caches", ["kind"], registry=r)
        for phase in ("draft", "final", "verify", "total"):  # export every series from the start
            self.cycle.labels(phase)
        for kind in ("target_kv", "draft_kv"):
            self.cache_bytes.labels(kind)
        for ep in ("completions", "chat"):
            for outcome in ("completed", "cancelled"):
                self.requests.labels(ep, outcome)

    def add_output_cache(self, cache) -> None:
        """Export the cross-request output cache's counters (read at each scrape)."""
        self.registry.register(_OutputCacheCollector(cache))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _OutputCacheCollector:
    """Reads :meth:`dspine.proposers.cache.OutputCache.stats` at scrape time."""

    def __init__(self, cache):
        self.cache = cache

    def collect(self):
        st = self.cache.stats()
        for key, name, doc in (("tokens", "tokens", "tokens held by the cross-request output cache"),
                               ("entries", "entries", "finished requests held by the output cache"),
                               ("tenants", "tenants", "tenants (API keys) with entries in the output cache"),
                               ("bytes_estimate", "bytes", "estimated bytes held by the output cache")):
            yield GaugeMetricFamily(f"dspine_ngram_cache_{name}", doc, value=st[key])
        yield CounterMetricFamily("dspine_ngram_cache_lookups", "output cache lookups", value=st["lookups"])
        yield CounterMetricFamily("dspine_ngram_cache_hits", "output cache lookups that found a continuation",
                                  value=st["hits"])
