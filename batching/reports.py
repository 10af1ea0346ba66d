"""What /stats, /metrics and /stats/timeline show, computed where the engine is: in this process, or in the
engine's own (ENGINE_PROCESS=on), which runs the same function on a Call from the front end. Each takes the
manager, then plain values (the reader's view as `every` and `tenant`), and returns what msgpack carries."""

from typing import TYPE_CHECKING

from batching import metrics
from batching.server_stats import server_stats
from batching.tenant_stats import TenantView, only_shown
from batching.timeline import timeline

if TYPE_CHECKING:
    from batching.manager import BatchingManager


def stats(manager: "BatchingManager", every: bool, tenant: str | None) -> dict:
    return only_shown(server_stats(manager), TenantView(every, tenant), manager.engine.scheduler.fair.ledger)


def prometheus(manager: "BatchingManager", every: bool, tenant: str | None) -> tuple[bytes, str]:
    """The exposition and its content type."""
    settings, engine = manager.settings.engine, manager.engine
    cache = engine.blocks.block_size, settings.kv_cache_dtype, settings.prefix_cache, engine.blocks.num_blocks
    infos = [metrics.cache_config_info(engine.model_name, *cache)]
    if every:
        running, waiting = manager.lora_names()
        infos.append(metrics.lora_requests_info(engine.model_name, running, waiting, settings.max_loras))
    return metrics.render(manager.live, manager.step_summary(), infos, TenantView(every, tenant))


def steps_and_events(
    manager: "BatchingManager", since: int, events_since: int, every: bool, tenant: str | None
) -> dict:
    return timeline(manager, since, events_since, TenantView(every, tenant))


REPORTS = {"stats": stats, "metrics": prometheus, "timeline": steps_and_events}
