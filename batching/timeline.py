"""GET /stats/timeline: the step records and request events after a client's cursors, the live
values, and latency and throughput over the last TIMELINE_WINDOW_S seconds.

Steps and events are paged separately (`since`, `events_since`): each has its own index, and a
client passes back the response's `next` to get only what is new. Only steps whose record is
final are returned, so a record is never sent half-written.
"""

import time
from typing import TYPE_CHECKING

from batching.events import ENDINGS, RequestEvent
from batching.live import live_values
from batching.stats import summary
from generate.engine import device_and_dtype
from generate.step_log import StepRecord

if TYPE_CHECKING:
    from batching.manager import BatchingManager


def timeline(manager: "BatchingManager", since: int = 0, events_since: int = 0) -> dict:
    now = time.time()
    kept_steps, kept_events = manager.finished_steps(), manager.events.since(0)
    steps = [r for r in kept_steps if r.index > since]
    events = [e for e in kept_events if e.index > events_since]
    window_s = manager.settings.timeline_window_s
    return {
        "now": now,
        "server": server_info(manager),
        "live": live_values(manager),
        "window": {
            "seconds": window_s,
            **output_rate(kept_steps, max(now - window_s, manager.started_at), now),
            **request_latency(kept_events, now, window_s),
        },
        "steps": [r.as_dict() for r in steps],
        "events": [e.as_dict() for e in events],
        "next": {
            # a cursor past the newest record (a restarted server) falls back to it, so the client catches up
            "since": steps[-1].index if steps else min(since, manager.steps_done),
            "events_since": events[-1].index if events else min(events_since, manager.events.count),
        },
    }


def server_info(manager: "BatchingManager") -> dict:
    """What the page's header shows: what is served, where, and the limits the charts are drawn against."""
    settings, engine = manager.settings, manager.engine
    if settings.engine == "sim":
        device = f"simulated {settings.sim_num_gpus} x {settings.sim_gpu}"
    else:
        device_type, dtype = device_and_dtype(settings)
        device = f"{device_type} {str(dtype).removeprefix('torch.')}"
    return {
        "mode": settings.mode,
        "model": engine.model_name,
        "random_weights": engine.is_random,
        "device": device,
        "max_batch_size": settings.max_batch_size,
        "max_batch_tokens": engine.max_batch_tokens,
        "block_size": settings.block_size,
        "prefix_cache": settings.prefix_cache,
        "started_at": manager.started_at,
    }


def output_rate(steps: list[StepRecord], start: float, now: float) -> dict:
    """Tokens sampled per second by the steps that started since `start` (or in the kept part of that time)."""
    if steps and steps[0].index > 1:  # the ring dropped older steps: count over what it still holds
        start = max(start, steps[0].started_at)
    recent = [r for r in steps if r.started_at >= start]
    span = now - start
    return {
        "steps": len(recent),
        "output_tokens_per_s": sum(r.num_sampled for r in recent) / span if span > 0 else 0.0,
    }


def request_latency(events: list[RequestEvent], now: float, window_s: float) -> dict:
    """TTFT and time per output token of the requests that finished in the window; endings by kind."""
    ended = [e for e in events if e.at >= now - window_s and e.kind in ENDINGS]
    finished = [e for e in ended if e.kind == "finished"]
    tpot = [(e.latency_s - e.ttft_s) / (e.generated_tokens - 1) for e in finished if e.generated_tokens > 1]
    return {
        "requests_finished": len(finished),
        "requests_failed": sum(e.kind == "failed" for e in ended),
        "requests_cancelled": sum(e.kind == "cancelled" for e in ended),
        "ttft_s": summary([e.ttft_s for e in finished]),
        "tpot_s": summary(tpot),
    }
