"""The server's live values in one home: the manager writes to it, /stats, /metrics, the timeline
and vLLM's metric names read from it.

Three kinds of value, one table:
  rows (LIVE_VALUES)  a figure read when asked: queues, KV blocks and engine counters, and the
                      since-start counts of Stats; each has a /stats key, a Prometheus name and,
                      where vLLM has one, vLLM's name. A new counter is one more row: keep the
                      count where it is counted and give the row a reader (labelled counters
                      read a {label value: count} dict).
  histograms          request latencies and lengths (histograms.py), observed as tokens arrive
                      and requests end.
  the window          latency and throughput over the last TIMELINE_WINDOW_S seconds (window.py).
This module imports nothing above it: the manager hands it the engine and a reader of its queue.
"""

import threading
import time
from collections.abc import Callable

from batching.histograms import HISTOGRAMS, SECONDS, Histogram, token_buckets
from batching.inference import Inference
from batching.live_value import LiveValue, Reading
from batching.stats import Stats, outcome
from batching.tenant_stats import TENANT_VALUES
from batching.window import StepTokens, Window
from generate.engine import Engine


def _hit_rate(live: "LiveTable") -> float:
    scheduler = live.engine.scheduler
    admitted = scheduler.prompt_tokens_admitted
    return scheduler.prompt_tokens_cached / admitted if admitted else 0.0


def _usage(live: "LiveTable") -> float:
    blocks = live.engine.blocks
    return blocks.num_used_blocks / blocks.num_blocks


LIVE_VALUES = (
    LiveValue(
        "requests_running",
        "gpt2_requests_running",
        "gauge",
        "Sequences in the running batch",
        lambda t: len(t.engine.scheduler.running),
        vllm=("vllm:num_requests_running",),
    ),
    LiveValue(
        "requests_waiting",
        "gpt2_requests_waiting",
        "gauge",
        "Requests waiting to be admitted",
        lambda t: t.num_waiting(),
        vllm=("vllm:num_requests_waiting",),
    ),
    LiveValue(
        "kv_blocks_used",
        "gpt2_kv_blocks_used",
        "gauge",
        "KV blocks referenced by sequences",
        lambda t: t.engine.blocks.num_used_blocks,
    ),
    LiveValue(
        "kv_blocks_total",
        "gpt2_kv_blocks_total",
        "gauge",
        "KV blocks in the pool",
        lambda t: t.engine.blocks.num_blocks,
    ),
    LiveValue(
        "kv_cache_usage",
        "gpt2_kv_cache_usage",
        "gauge",
        "Share of the KV blocks referenced by sequences (0 to 1)",
        _usage,
        vllm=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    LiveValue(
        "kv_blocks_cached",
        "gpt2_kv_blocks_cached",
        "gauge",
        "KV blocks held by the prefix cache",
        lambda t: t.engine.blocks.num_cached_blocks,
    ),
    LiveValue(
        "kv_blocks_evictable",
        "gpt2_kv_blocks_evictable",
        "gauge",
        "Cached KV blocks no sequence references (reused if their prefix comes back, else evicted)",
        lambda t: t.engine.blocks.num_evictable_blocks,
    ),
    LiveValue(
        "kv_blocks_free",
        "gpt2_kv_blocks_free",
        "gauge",
        "KV blocks that can be handed out (evictable included)",
        lambda t: t.engine.blocks.num_free_blocks,
    ),
    LiveValue(
        "prefix_cache_hit_rate", None, "gauge", "Share of admitted prompt tokens found in the prefix cache", _hit_rate
    ),
    LiveValue(
        "prefix_cache_hit_tokens",
        "gpt2_prefix_cache_hit_tokens",
        "counter",
        "Prompt tokens found in the prefix cache",
        lambda t: t.engine.scheduler.prompt_tokens_cached,
        vllm=("vllm:prefix_cache_hits",),
    ),
    LiveValue(
        "prefix_cache_query_tokens",
        "gpt2_prefix_cache_query_tokens",
        "counter",
        "Prompt tokens admitted",
        lambda t: t.engine.scheduler.prompt_tokens_admitted,
        vllm=("vllm:prefix_cache_queries",),
    ),
    LiveValue(
        "evictions", "gpt2_kv_evictions", "counter", "Cached KV blocks evicted", lambda t: t.engine.blocks.evictions
    ),
    LiveValue(
        "preemptions",
        "gpt2_preemptions",
        "counter",
        "Sequences preempted for memory",
        lambda t: t.engine.scheduler.num_preemptions,
        vllm=("vllm:num_preemptions",),
    ),
    LiveValue("steps", "gpt2_steps", "counter", "Engine steps run", lambda t: t.engine.num_steps),
    LiveValue(
        "prompt_tokens",
        "gpt2_prompt_tokens",
        "counter",
        "Prompt tokens of the requests that got their first token (counted once, whatever preemptions)",
        lambda t: t.stats.prompt_tokens,
        vllm=("vllm:prompt_tokens",),
    ),
    LiveValue(
        "tokens_generated",
        "gpt2_generated_tokens",
        "counter",
        "Tokens generated, counted as they are generated (finished requests or not)",
        lambda t: t.stats.tokens_generated,
        vllm=("vllm:generation_tokens",),
    ),
    LiveValue(
        "requests_by_outcome",
        "gpt2_requests",
        "counter",
        "Answered requests by outcome",
        lambda t: t.stats.by_outcome(),
        label="outcome",
    ),
    LiveValue(
        "finish_reasons",
        "gpt2_request_finish_reasons",
        "counter",
        "Answered requests by finish reason (abort: cancelled)",
        lambda t: t.stats.finished_reasons(),
        label="finished_reason",
        vllm=("vllm:request_success",),
    ),
    LiveValue(
        "requests_refused",
        "gpt2_requests_refused",
        "counter",
        "Requests refused at admission, by reason (batching/admission.py)",
        lambda t: t.refused(),
        label="reason",
    ),
    # structured output (generate/constraints.py, generate/grammar_mask.py)
    LiveValue(
        "constrained_requests",
        "gpt2_constrained_requests",
        "counter",
        "Requests admitted with a constraint (structured output)",
        lambda t: t.engine.grammar.stats.constrained_requests,
    ),
    LiveValue(
        "constraint_compiles",
        "gpt2_constraint_compiles",
        "counter",
        "Constraints compiled",
        lambda t: t.engine.constraints.stats().compiles,
    ),
    LiveValue(
        "constraint_cache_hits",
        "gpt2_constraint_cache_hits",
        "counter",
        "Constraints taken from the compile cache",
        lambda t: t.engine.constraints.stats().cache_hits,
    ),
    LiveValue(
        "constraint_compile_mean_s",
        "gpt2_constraint_compile_mean_seconds",
        "gauge",
        "Mean compile time of recent constraints",
        lambda t: t.engine.constraints.stats().mean_s,
    ),
    LiveValue(
        "constraint_compile_p99_s",
        "gpt2_constraint_compile_p99_seconds",
        "gauge",
        "99th percentile compile time of recent constraints",
        lambda t: t.engine.constraints.stats().p99_s,
    ),
    LiveValue(
        "mask_fill_mean_s",
        "gpt2_mask_fill_mean_seconds",
        "gauge",
        "Mean time filling a step's token masks (overlapped with the forward pass), over steps with any",
        lambda t: t.engine.grammar.stats.mean_fill_s(),
    ),
    LiveValue(
        "mask_wait_mean_s",
        "gpt2_mask_wait_mean_seconds",
        "gauge",
        "Mean time the loop waited for and applied a step's token masks, over steps with any",
        lambda t: t.engine.grammar.stats.mean_wait_s(),
    ),
    *TENANT_VALUES,
)
__all__ = ["LIVE_VALUES", "LiveTable", "LiveValue", "Reading"]


class LiveTable:
    """Written by the loop thread (tokens of a step, answered requests), read by request threads."""

    def __init__(
        self,
        engine: Engine,
        window_s: float,
        num_waiting: Callable[[], int],
        refused: Callable[[], dict[str, int]],
    ) -> None:
        self.engine, self.num_waiting, self.refused = engine, num_waiting, refused
        self.model_name = engine.model_name
        self.started_at = time.time()  # Unix time
        self.stats = Stats()
        self.window = Window(window_s, self.started_at)
        bounds = {"seconds": SECONDS, "tokens": token_buckets(engine.max_sequence_tokens)}
        self.histograms = {h.key: Histogram(bounds[h.unit]) for h in HISTOGRAMS}
        self._lock = threading.Lock()  # guards the histograms

    # --- written by the loop thread --------------------------------------------------------------
    def tokens_delivered(self, tokens: int, firsts: list[Inference], gaps: list[tuple[int, float]]) -> None:
        """One step's tokens: `firsts` got their first token (or prompt-only answer), `gaps` are
        (request id, seconds since its previous token) of every later token."""
        ttfts = tuple(inference.ttft_s for inference in firsts)
        with self._lock:
            for ttft in ttfts:
                self.histograms["ttft"].observe(ttft)
            for _, gap in gaps:
                self.histograms["itl"].observe(gap)
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
    def values(self) -> dict[str, Reading]:
        return {v.key: v.read(self) for v in LIVE_VALUES}

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
