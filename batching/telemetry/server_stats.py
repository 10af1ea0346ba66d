"""GET /stats: what is served, the live values, the windowed figures beside the since-start ones,
and the recent steps. Every figure comes from the live table (live.py) or the step log; the per-tenant ones
only for the tenants the reader's view shows.

Two kinds of latency and throughput, under names that say which:
  "window"                      the last TIMELINE_WINDOW_S seconds, counted as tokens come (window.py);
  top-level ttft_s, tpot_s, latency_s, throughput_tokens_per_s
                                since the server started (percentiles: the latest answered requests).
"""

from typing import TYPE_CHECKING

from batching.telemetry.tenant_stats import EVERY_TENANT, TenantView

if TYPE_CHECKING:
    from batching.manager import BatchingManager


def server_stats(manager: "BatchingManager", view: TenantView = EVERY_TENANT) -> dict:
    live = manager.live
    return {
        "mode": manager.settings.mode,
        "model": manager.engine.model_name,
        "prefix_cache": manager.settings.engine.prefix_cache,
        "kv_cache_dtype": manager.settings.engine.kv_cache_dtype,
        "block_size": manager.settings.engine.block_size,
        "kv_cache_integrity": manager.cache_problem or "ok",
        **live.values(view),
        "window": live.window_figures(),
        "recent_steps": manager.step_summary().as_stats(),
        **live.stats.snapshot(),
    }
