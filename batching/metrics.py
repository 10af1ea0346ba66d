"""GET /metrics: Prometheus counters and histograms of answered requests, and live gauges.

Each server gets its own registry, so several apps in one process (tests) never clash.
Values owned by the engine (KV blocks, prefix hits, preemptions, steps) are read at scrape time
from the same table as /stats (batching.live).
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batching.inference import Inference
from batching.live import LIVE_VALUES
from batching.step_summary import StepSummary

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
    """The live values table (batching.live) and the recent steps' figures, read at scrape time."""

    def __init__(self, manager: "BatchingManager") -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        for value in LIVE_VALUES:
            if value.metric:
                family = GaugeMetricFamily if value.kind == "gauge" else CounterMetricFamily
                yield family(value.metric, value.help, value=value.read(self.manager))
        refused = CounterMetricFamily("gpt2_requests_refused", "Requests refused at admission", labels=["reason"])
        for reason, count in self.manager.admission.counts().items():
            refused.add_metric([reason], count)
        yield refused
        yield from _recent_steps(self.manager.step_summary())


def _recent_steps(summary: StepSummary) -> Iterator[Metric]:
    """Gauges over the kept step records: a step-time histogram would cost the loop an observation per step."""
    yield GaugeMetricFamily(
        "gpt2_recent_steps",
        "Steps kept in the step log, which the gpt2_recent_step_* gauges summarise",
        value=summary.steps,
    )
    yield GaugeMetricFamily(
        "gpt2_recent_steps_with_prefill",
        "Of the recent steps, those that computed a prompt chunk",
        value=summary.steps_with_prefill,
    )
    step_time = GaugeMetricFamily("gpt2_recent_step_seconds", "Step time over the recent steps", labels=["stat"])
    for stat, seconds in summary.step_time_s.items():
        if seconds is not None:
            step_time.add_metric([stat], seconds)
    yield step_time
    stages = GaugeMetricFamily(
        "gpt2_recent_step_stage_seconds", "Mean seconds per recent step spent in each stage", labels=["stage"]
    )
    for stage, seconds in summary.stage_time_s.items():
        if seconds is not None:
            stages.add_metric([stage], seconds)
    yield stages
