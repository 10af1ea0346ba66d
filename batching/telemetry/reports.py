"""What /stats, /metrics and /stats/timeline show, computed where the engine is: in this process, or in the
engine's own (ENGINE_PROCESS=on), which runs the same function on a Call from the front end. Each takes the
manager, then plain values (the reader's view as `every` and `tenant`), and returns what msgpack carries."""

from typing import TYPE_CHECKING

from batching.telemetry import metrics
from batching.telemetry.server_stats import server_stats
from batching.telemetry.tenant_stats import TenantView
from batching.telemetry.timeline import timeline

if TYPE_CHECKING:
    from batching.manager import BatchingManager


def stats(manager: "BatchingManager", every: bool, tenant: str | None) -> dict:
    return server_stats(manager, TenantView(every, tenant))


def prometheus(manager: "BatchingManager", every: bool, tenant: str | None) -> tuple[bytes, str]:
    """The exposition and its content type."""
    settings, live = manager.settings.engine, manager.live
    values = live.values(TenantView(every, tenant))
    cache = settings.block_size, settings.kv_cache_dtype, settings.prefix_cache, values["kv_blocks_total"]
    infos = [metrics.cache_config_info(live.model_name, *cache)]
    if every:
        running, waiting = manager.lora_names()
        infos.append(metrics.lora_requests_info(live.model_name, running, waiting, settings.max_loras))
    return metrics.render(live, values, manager.step_summary(), infos)


def steps_and_events(
    manager: "BatchingManager", since: int, events_since: int, every: bool, tenant: str | None
) -> dict:
    return timeline(manager, since, events_since, TenantView(every, tenant))


REPORTS = {"stats": stats, "metrics": prometheus, "timeline": steps_and_events}
