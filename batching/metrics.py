"""GET /metrics: Prometheus counters and histograms of answered requests, and live gauges.

Each server gets its own registry, so several apps in one process (tests) never clash.
Values owned by the engine (KV blocks, prefix hits, preemptions) are read at scrape time.
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batching.inference import Inference

if TYPE_CHECKING:
    from batching.manager import BatchingManager

# 1 ms to 10 min, roughly x2.5 apart: TPOT lives at the low end, queueing at the high end.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300, 600)
OUTCOMES = ("ok", "error", "cancelled")


class ServerMetrics:
    def __init__(self, manager: "BatchingManager") -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("gpt2_requests", "Answered requests by outcome", ["outcome"], registry=self.registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.generated = Counter("gpt2_generated_tokens", "Tokens generated", registry=self.registry)
        self.prompt = Counter("gpt2_prompt_tokens", "Prompt tokens of answered requests", registry=self.registry)
        self.ttft = Histogram("gpt2_ttft_seconds", "Time to first token", buckets=BUCKETS, registry=self.registry)
        self.tpot = Histogram(
            "gpt2_tpot_seconds", "Time per output token after the first", buckets=BUCKETS, registry=self.registry
        )
        self.latency = Histogram(
            "gpt2_request_latency_seconds", "End-to-end latency", buckets=BUCKETS, registry=self.registry
        )
        self.registry.register(_LiveValues(manager))

    def observe(self, inf: Inference) -> None:
        """Count one answered inference (called once per inference, from the loop thread)."""
        outcome = "ok" if inf.error is None else "cancelled" if inf.error == "cancelled" else "error"
        self.requests.labels(outcome).inc()
        if outcome != "ok":
            return
        n = len(inf.generated_ids)
        self.generated.inc(n)
        self.prompt.inc(len(inf.prompt_ids))
        self.ttft.observe(inf.ttft_s)
        self.latency.observe(inf.latency_s)
        if n > 1:
            self.tpot.observe((inf.latency_s - inf.ttft_s) / (n - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _LiveValues(Collector):
    def __init__(self, manager: "BatchingManager") -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        manager = self.manager
        blocks, scheduler = manager.engine.blocks, manager.engine.scheduler
        gauges = {
            "gpt2_requests_running": ("Sequences in the running batch", manager.num_running()),
            "gpt2_requests_waiting": ("Requests waiting to be admitted", manager.num_waiting()),
            "gpt2_kv_blocks_used": ("KV blocks referenced by sequences", blocks.num_used_blocks),
            "gpt2_kv_blocks_total": ("KV blocks in the pool", blocks.num_blocks),
            "gpt2_kv_blocks_cached": ("KV blocks held by the prefix cache", blocks.num_cached_blocks),
        }
        counters = {
            "gpt2_prefix_cache_hit_tokens": ("Prompt tokens found in the prefix cache", scheduler.prompt_tokens_cached),
            "gpt2_prefix_cache_query_tokens": ("Prompt tokens admitted", scheduler.prompt_tokens_admitted),
            "gpt2_preemptions": ("Sequences preempted for memory", scheduler.num_preemptions),
            "gpt2_kv_evictions": ("Cached KV blocks evicted", blocks.evictions),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
