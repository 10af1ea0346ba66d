"""The server's live values in one home: the manager writes to it, /stats, /metrics, the timeline
and vLLM's metric names read from it.

Three kinds of value, one table:
  rows (LIVE_VALUES)  a figure read when asked: queues, KV blocks and engine counters, and the
                      since-start counts of Stats; each has a /stats key, a Prometheus name and,
                      where vLLM has one, vLLM's name. A new counter is one more row: keep the
                      count where it is counted; an engine counter is one more field of
                      EngineCounters (generate/engine_counters.py) under the row's key, anything
                      else a reader (labelled counters read a {label value: count} dict).
  histograms          request latencies and lengths (histograms.py), observed as tokens arrive
                      and requests end.
  the window          latency and throughput over the last TIMELINE_WINDOW_S seconds (window.py).
A reading takes one snapshot of the engine's counters, so its rows agree with each other. This module
imports nothing above it: the observer hands it a reader of the engine's counters and of its queue.
"""

import threading
import time
from collections.abc import Callable

from batching.inference import Inference
from batching.telemetry.histograms import HISTOGRAMS, SECONDS, Histogram, token_buckets
from batching.telemetry.live_value import LiveValue, Reading
from batching.telemetry.stats import Stats, outcome
from batching.telemetry.tenant_stats import EVERY_TENANT, TENANT_VALUES, TenantView, only_shown
from batching.telemetry.window import StepTokens, Window
from generate.engine_counters import EngineCounters


def _hit_rate(_: "LiveTable", engine: EngineCounters) -> float:
    admitted = engine.prefix_cache_query_tokens
    return engine.prefix_cache_hit_tokens / admitted if admitted else 0.0


def _usage(_: "LiveTable", engine: EngineCounters) -> float:
    return engine.kv_blocks_used / engine.kv_blocks_total


# Rows without a reader show the engine's counter named by their key.
LIVE_VALUES = (
    LiveValue(
        "requests_running",
        "gpt2_requests_running",
        "gauge",
        "Sequences in the running batch",
        vllm=("vllm:num_requests_running",),
    ),
    LiveValue(
        "requests_waiting",
        "gpt2_requests_waiting",
        "gauge",
        "Requests waiting to be admitted",
        lambda t, _: t.num_waiting(),
        vllm=("vllm:num_requests_waiting",),
    ),
    LiveValue("kv_blocks_used", "gpt2_kv_blocks_used", "gauge", "KV blocks referenced by sequences"),
    LiveValue("kv_blocks_total", "gpt2_kv_blocks_total", "gauge", "KV blocks in the pool"),
    LiveValue(
        "kv_cache_usage",
        "gpt2_kv_cache_usage",
        "gauge",
        "Share of the KV blocks referenced by sequences (0 to 1)",
        _usage,
        vllm=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    LiveValue("kv_blocks_cached", "gpt2_kv_blocks_cached", "gauge", "KV blocks held by the prefix cache"),
    LiveValue(
        "kv_blocks_evictable",
        "gpt2_kv_blocks_evictable",
        "gauge",
        "Cached KV blocks no sequence references (reused if their prefix comes back, else evicted)",
    ),
    LiveValue(
        "kv_blocks_free", "gpt2_kv_blocks_free", "gauge", "KV blocks that can be handed out (evictable included)"
    ),
    LiveValue(
        "prefix_cache_hit_rate", None, "gauge", "Share of admitted prompt tokens found in the prefix cache", _hit_rate
    ),
    LiveValue(
        "prefix_cache_hit_tokens",
        "gpt2_prefix_cache_hit_tokens",
        "counter",
        "Prompt tokens found in the prefix cache",
        vllm=("vllm:prefix_cache_hits",),
    ),
    LiveValue(
        "prefix_cache_query_tokens",
        "gpt2_prefix_cache_query_tokens",
        "counter",
        "Prompt tokens admitted",
        vllm=("vllm:prefix_cache_queries",),
    ),
    LiveValue("evictions", "gpt2_kv_evictions", "counter", "Cached KV blocks evicted"),
    LiveValue(
        "preemptions",
        "gpt2_preemptions",
        "counter",
        "Sequences preempted for memory",
        vllm=("vllm:num_preemptions",),
    ),
    LiveValue("steps", "gpt2_steps", "counter", "Engine steps run"),
    LiveValue(
        "prompt_tokens",
        "gpt2_prompt_tokens",
        "counter",
        "Prompt tokens of the requests that got their first token (counted once, whatever preemptions)",
        lambda t, _: t.stats.prompt_tokens,
        vllm=("vllm:prompt_tokens",),
    ),
    LiveValue(
        "tokens_generated",
        "gpt2_generated_tokens",
        "counter",
        "Tokens generated, counted as they are generated (finished requests or not)",
        lambda t, _: t.stats.tokens_generated,
        vllm=("vllm:generation_tokens",),
    ),
    LiveValue(
        "requests_by_outcome",
        "gpt2_requests",
        "counter",
        "Answered requests by outcome",
        lambda t, _: t.stats.by_outcome(),
        label="outcome",
    ),
    LiveValue(
        "finish_reasons",
        "gpt2_request_finish_reasons",
        "counter",
        "Answered requests by finish reason (abort: cancelled)",
        lambda t, _: t.stats.finished_reasons(),
        label="finished_reason",
        vllm=("vllm:request_success",),
    ),
    LiveValue(
        "requests_refused",
        "gpt2_requests_refused",
        "counter",
        "Requests refused at admission, by reason (batching/admission.py)",
        lambda t, _: t.refused(),
        label="reason",
    ),
    # structured output (generate/constraints.py, generate/grammar_mask.py)
    LiveValue(
        "constrained_requests",
        "gpt2_constrained_requests",
        "counter",
        "Requests admitted with a constraint (structured output)",
    ),
    LiveValue("constraint_compiles", "gpt2_constraint_compiles", "counter", "Constraints compiled"),
    LiveValue(
        "constraint_cache_hits", "gpt2_constraint_cache_hits", "counter", "Constraints taken from the compile cache"
    ),
    LiveValue(
        "constraint_compile_mean_s",
        "gpt2_constraint_compile_mean_seconds",
        "gauge",
        "Mean compile time of recent constraints",
    ),
    LiveValue(
        "constraint_compile_p99_s",
        "gpt2_constraint_compile_p99_seconds",
        "gauge",
        "99th percentile compile time of recent constraints",
    ),
    LiveValue(
        "mask_fill_mean_s",
        "gpt2_mask_fill_mean_seconds",
        "gauge",
        "Mean time filling a step's token masks (overlapped with the forward pass), over steps with any",
    ),
    LiveValue(
        "mask_wait_mean_s",
        "gpt2_mask_wait_mean_seconds",
        "gauge",
        "Mean time the loop waited for and applied a step's token masks, over steps with any",
    ),
    *TENANT_VALUES,
)
# every row without a reader names a counter of the engine's: a typo fails at import, not at the first scrape
assert all(row.read or row.key in EngineCounters.__struct_fields__ for row in LIVE_VALUES)
__all__ = ["LIVE_VALUES", "LiveTable", "LiveValue", "Reading"]


class LiveTable:
    """Written by the loop thread (tokens of a step, answered requests), read by request threads."""

    def __init__(
        self,
        engine_counters: Callable[[], EngineCounters],
        model_name: str,
        max_sequence_tokens: int,
        window_s: float,
        num_waiting: Callable[[], int],
        refused: Callable[[], dict[str, int]],
    ) -> None:
        self.engine_counters, self.num_waiting, self.refused = engine_counters, num_waiting, refused
        self.model_name = model_name
        self.started_at = time.time()  # Unix time
        self.stats = Stats()
        self.window = Window(window_s, self.started_at)
        bounds = {"seconds": SECONDS, "tokens": token_buckets(max_sequence_tokens)}
        self.histograms = {h.key: Histogram(bounds[h.unit]) for h in HISTOGRAMS}
        self._lock = threading.Lock()  # guards the histograms

    # --- written by the loop thread --------------------------------------------------------------
    def tokens_delivered(self, tokens: int, firsts: list[Inference], gaps: list[tuple[int, float]]) -> None:
        """One step's tokens: `firsts` got their first token (or prompt-only answer), `gaps` are
        (request id, seconds since its previous token) of every later token."""
        ttfts = tuple(inference.ttft_s for inference in firsts)
        with self._lock:
            self.histograms["ttft"].observe_all(ttfts)
            self.histograms["itl"].observe_all(gap for _, gap in gaps)
        self.stats.count_tokens(sum(inference.seq.num_prompt_tokens for inference in firsts), tokens)
        self.window.add_step(StepTokens(time.time(), tokens, ttfts, tuple(gaps)))

    def answered(self, inference: Inference) -> None:
        """One inference answered: its outcome, and for a success its latencies and lengths."""
        self.stats.record(inference)
        kind = outcome(inference)
        self.window.add_ending(time.time(), {"ok": "finished", "error": "failed"}.get(kind, kind))
        if kind == "ok":
            with self._lock:
                for key, value in _request_figures(inference).items():
                    self.histograms[key].observe(value)

    # --- read by request threads ------------------------------------------------------------------
    def values(self, view: TenantView = EVERY_TENANT) -> dict[str, Reading]:
        """Every row, from one snapshot of the engine's counters; the per-tenant rows cut to what `view` shows."""
        engine = self.engine_counters()
        values = {row.key: row.reading(self, engine) for row in LIVE_VALUES}
        return only_shown(values, view, engine.tenant_labels)

    def histogram_readings(self) -> dict[str, tuple[list[tuple[str, int]], float]]:
        with self._lock:
            return {key: h.cumulative() for key, h in self.histograms.items()}

    def window_figures(self) -> dict:
        return self.window.figures(time.time())


def _request_figures(inference: Inference) -> dict[str, float]:
    """What one successful request adds to the histograms (vLLM's definitions)."""
    n = len(inference.generated_ids)
    figures = {
        "e2e": inference.latency_s,
        "decode": inference.finished_at - inference.first_token_at,
        "prompt_tokens": len(inference.prompt_ids),
        "generation_tokens": n,
        "max_tokens": inference.params.max_tokens,
    }
    if inference.scheduled_at is not None:
        figures["queue"] = inference.scheduled_at - inference.arrival
        figures["prefill"] = inference.first_token_at - inference.scheduled_at
    if n > 1:
        figures["tpot"] = (inference.latency_s - inference.ttft_s) / (n - 1)
    return figures
