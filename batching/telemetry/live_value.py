"""One row of the live table (live.py): a figure read when asked, under its /stats key, its Prometheus name and
vLLM's."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from generate.engine_counters import EngineCounters

if TYPE_CHECKING:
    from batching.telemetry.live import LiveTable

Reading = float | dict[str, float]


@dataclass(frozen=True, slots=True)
class LiveValue:
    key: str  # in /stats and the timeline's "live"
    metric: str | None  # Prometheus name (a counter's samples get "_total"); None: JSON only
    kind: str  # "gauge" or "counter"
    help: str
    # what the row shows, from the table and a snapshot of the engine's counters; None: the engine's counter
    # of the same name as `key` (a field of EngineCounters)
    read: Callable[["LiveTable", EngineCounters], Reading] | None = None
    label: str | None = None  # a labelled value reads {label value: number}
    vllm: tuple[str, ...] = ()  # vLLM's names for the same value, labelled model_name

    def reading(self, table: "LiveTable", engine: EngineCounters) -> Reading:
        return getattr(engine, self.key) if self.read is None else self.read(table, engine)
