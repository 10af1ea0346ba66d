"""GET /stats/timeline: the step records and request events after a client's cursors, the live
values, and latency and throughput over the last TIMELINE_WINDOW_S seconds (the live table's window,
the same figures as /stats "window").

Steps and events are paged separately (`since`, `events_since`): each has its own index, and a
client passes back the response's `next` to get only what is new. Only steps whose record is
final are returned, so a record is never sent half-written. A reader shown only its own tenant
(`TenantView`) gets that tenant's request events and figures alone; the steps, whose-ever they are, show
only counts.
"""

import time
from typing import TYPE_CHECKING

from batching.telemetry.tenant_stats import EVERY_TENANT, TenantView
from generate.engine import device_and_dtype

if TYPE_CHECKING:
    from batching.manager import BatchingManager


def timeline(
    manager: "BatchingManager", since: int = 0, events_since: int = 0, view: TenantView = EVERY_TENANT
) -> dict:
    now = time.time()
    kept_steps, kept_events = manager.finished_steps(), manager.events.since(0)
    steps = [r for r in kept_steps if r.index > since]
    newer = [e for e in kept_events if e.index > events_since]  # the cursor moves past others' events too
    events = [e for e in newer if view.shows(e.tenant)]
    return {
        "now": now,
        "server": server_info(manager),
        "live": manager.live.values(view),
        "window": manager.live.window_figures(),
        "steps": [r.as_dict() for r in steps],
        "events": [e.as_dict() for e in events],
        "next": {
            # a cursor past the newest record (a restarted server) falls back to it, so the client catches up
            "since": steps[-1].index if steps else min(since, manager.steps_done),
            "events_since": newer[-1].index if newer else min(events_since, manager.events.count),
        },
    }


def server_info(manager: "BatchingManager") -> dict:
    """What the page's header shows: what is served, where, and the limits the charts are drawn against."""
    settings, engine = manager.settings, manager.engine
    engine_settings = settings.engine
    if engine_settings.engine == "sim":
        device = f"simulated {engine_settings.sim_num_gpus} x {engine_settings.sim_gpu}"
    else:
        device_type, dtype = device_and_dtype(engine_settings)
        device = f"{device_type} {str(dtype).removeprefix('torch.')}"
    return {
        "mode": settings.mode,
        "model": engine.model_name,
        "random_weights": engine.is_random,
        "device": device,
        "max_batch_size": engine_settings.max_batch_size,
        "max_batch_tokens": engine.max_batch_tokens,
        "block_size": engine_settings.block_size,
        "kv_cache_dtype": engine_settings.kv_cache_dtype,
        "prefix_cache": engine_settings.prefix_cache,
        "started_at": manager.started_at,
    }
