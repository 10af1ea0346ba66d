"""The server's live values in one table, which /stats, /metrics and the timeline all render.

Each row reads one figure when asked (queues from the manager, the KV pool from the block
manager, counters from the scheduler and engine), so a value added here shows up under its
/stats key and, if it has one, its Prometheus name, and the two can never disagree.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batching.manager import BatchingManager


@dataclass(frozen=True, slots=True)
class LiveValue:
    key: str  # in /stats and the timeline's "live"
    metric: str | None  # Prometheus name (a counter's samples get "_total"); None: JSON only
    kind: str  # "gauge" or "counter"
    help: str
    read: Callable[["BatchingManager"], float]


def _hit_rate(manager: "BatchingManager") -> float:
    scheduler = manager.engine.scheduler
    admitted = scheduler.prompt_tokens_admitted
    return scheduler.prompt_tokens_cached / admitted if admitted else 0.0


LIVE_VALUES = (
    LiveValue(
        "requests_running",
        "gpt2_requests_running",
        "gauge",
        "Sequences in the running batch",
        lambda m: m.num_running(),
    ),
    LiveValue(
        "requests_waiting",
        "gpt2_requests_waiting",
        "gauge",
        "Requests waiting to be admitted",
        lambda m: m.num_waiting(),
    ),
    LiveValue(
        "kv_blocks_used",
        "gpt2_kv_blocks_used",
        "gauge",
        "KV blocks referenced by sequences",
        lambda m: m.engine.blocks.num_used_blocks,
    ),
    LiveValue(
        "kv_blocks_total",
        "gpt2_kv_blocks_total",
        "gauge",
        "KV blocks in the pool",
        lambda m: m.engine.blocks.num_blocks,
    ),
    LiveValue(
        "kv_blocks_cached",
        "gpt2_kv_blocks_cached",
        "gauge",
        "KV blocks held by the prefix cache",
        lambda m: m.engine.blocks.num_cached_blocks,
    ),
    LiveValue(
        "kv_blocks_evictable",
        "gpt2_kv_blocks_evictable",
        "gauge",
        "Cached KV blocks no sequence references (reused if their prefix comes back, else evicted)",
        lambda m: m.engine.blocks.num_evictable_blocks,
    ),
    LiveValue(
        "kv_blocks_free",
        "gpt2_kv_blocks_free",
        "gauge",
        "KV blocks that can be handed out (evictable included)",
        lambda m: m.engine.blocks.num_free_blocks,
    ),
    LiveValue(
        "prefix_cache_hit_rate", None, "gauge", "Share of admitted prompt tokens found in the prefix cache", _hit_rate
    ),
    LiveValue(
        "prefix_cache_hit_tokens",
        "gpt2_prefix_cache_hit_tokens",
        "counter",
        "Prompt tokens found in the prefix cache",
        lambda m: m.engine.scheduler.prompt_tokens_cached,
    ),
    LiveValue(
        "prefix_cache_query_tokens",
        "gpt2_prefix_cache_query_tokens",
        "counter",
        "Prompt tokens admitted",
        lambda m: m.engine.scheduler.prompt_tokens_admitted,
    ),
    LiveValue(
        "evictions", "gpt2_kv_evictions", "counter", "Cached KV blocks evicted", lambda m: m.engine.blocks.evictions
    ),
    LiveValue(
        "preemptions",
        "gpt2_preemptions",
        "counter",
        "Sequences preempted for memory",
        lambda m: m.engine.scheduler.num_preemptions,
    ),
    LiveValue("steps", "gpt2_steps", "counter", "Engine steps run", lambda m: m.engine.num_steps),
)


def live_values(manager: "BatchingManager") -> dict[str, float]:
    return {v.key: v.read(manager) for v in LIVE_VALUES}


def server_stats(manager: "BatchingManager") -> dict:
    """GET /stats: the live values, the recent steps, and the answered requests' counters and latencies."""
    return {
        "mode": manager.settings.mode,
        "model": manager.engine.model_name,
        "prefix_cache": manager.settings.prefix_cache,
        "kv_cache_integrity": manager.cache_problem or "ok",
        **live_values(manager),
        "requests_refused": manager.admission.counts(),  # by reason (batching/admission.py)
        "recent_steps": manager.step_summary().as_stats(),
        **manager.stats.snapshot(),
    }
