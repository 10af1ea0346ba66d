"""Latency and length distributions of the answered requests, kept as Prometheus-style buckets.

One set of histograms is kept (in the live table); /metrics renders each under the project's own
name and, where it has one, under vLLM's, so the two can never count differently.
"""

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass

# 1 ms to 10 min, roughly x2.5 apart: inter-token gaps live at the low end, queueing at the high end.
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300, 600)


def token_buckets(max_tokens: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the longest sequence the server can hold (vLLM's choice for lengths)."""
    bounds, power = [], 1
    while True:
        for m in (1, 2, 5):
            if m * power > max_tokens:
                return tuple(bounds)
            bounds.append(float(m * power))
        power *= 10


@dataclass(frozen=True, slots=True)
class HistogramSpec:
    key: str  # the live table's name for it
    metric: str | None  # the project's Prometheus name (None: vLLM's name only)
    vllm: tuple[str, ...]  # vLLM's names for the same observations
    help: str
    unit: str  # "seconds" or "tokens": which buckets


HISTOGRAMS = (
    HistogramSpec("ttft", "gpt2_ttft_seconds", ("vllm:time_to_first_token_seconds",), "Time to first token", "seconds"),
    HistogramSpec(
        "itl",
        "gpt2_inter_token_seconds",
        ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"),
        "Gap between consecutive generated tokens of a request (one observation per token after the first)",
        "seconds",
    ),
    HistogramSpec(
        "tpot",
        "gpt2_tpot_seconds",
        ("vllm:request_time_per_output_token_seconds",),
        "A request's mean time per output token after the first",
        "seconds",
    ),
    HistogramSpec(
        "e2e",
        "gpt2_request_latency_seconds",
        ("vllm:e2e_request_latency_seconds",),
        "End-to-end latency, arrival to last token",
        "seconds",
    ),
    HistogramSpec("queue", None, ("vllm:request_queue_time_seconds",), "Arrival to first being scheduled", "seconds"),
    HistogramSpec("prefill", None, ("vllm:request_prefill_time_seconds",), "First scheduled to first token", "seconds"),
    HistogramSpec("decode", None, ("vllm:request_decode_time_seconds",), "First token to last token", "seconds"),
    HistogramSpec("prompt_tokens", None, ("vllm:request_prompt_tokens",), "Prompt tokens per request", "tokens"),
    HistogramSpec(
        "generation_tokens", None, ("vllm:request_generation_tokens",), "Generated tokens per request", "tokens"
    ),
    HistogramSpec(
        "max_tokens",
        None,
        ("vllm:request_max_num_generation_tokens",),
        "The max_tokens a request asked for",
        "tokens",
    ),
)


class Histogram:
    """Bucket counts (not cumulative), their sum and count; the live table's lock guards it."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # a bound is inclusive ("le")
        self.sum += value

    def observe_all(self, values: Iterable[float]) -> None:
        """observe() of each value (a step's inter-token gaps: one call a step, not one a token)."""
        counts, bounds, total, last, bucket = self.counts, self.bounds, 0.0, None, 0
        for value in values:
            if value != last:  # a step's gaps are mostly one value: its rows' previous tokens came in one step
                last, bucket = value, bisect_left(bounds, value)
            counts[bucket] += 1
            total += value
        self.sum += total

    def cumulative(self) -> tuple[list[tuple[str, int]], float]:
        """[(le, count), ...] ending with +Inf, and the sum: what a Prometheus histogram exposes."""
        buckets, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            total += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return buckets, self.sum
