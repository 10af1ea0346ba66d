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
    loras = None
    if every:
        running, waiting = manager.lora_names()
        max_loras = manager.settings.engine.max_loras
        loras = metrics.lora_requests_info(manager.engine.model_name, running, waiting, max_loras)
    return metrics.render(manager.live, manager.step_summary(), loras, TenantView(every, tenant))


def steps_and_events(
    manager: "BatchingManager", since: int, events_since: int, every: bool, tenant: str | None
) -> dict:
    return timeline(manager, since, events_since, TenantView(every, tenant))


REPORTS = {"stats": stats, "metrics": prometheus, "timeline": steps_and_events}
