"""One row of the live table (batching/live.py): a figure read when asked, under its /stats key, its
Prometheus name and vLLM's."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batching.live import LiveTable

Reading = float | dict[str, float]


@dataclass(frozen=True, slots=True)
class LiveValue:
    key: str  # in /stats and the timeline's "live"
    metric: str | None  # Prometheus name (a counter's samples get "_total"); None: JSON only
    kind: str  # "gauge" or "counter"
    help: str
    read: Callable[["LiveTable"], Reading]
    label: str | None = None  # a labelled value reads {label value: number}
    vllm: tuple[str, ...] = ()  # vLLM's names for the same value, labelled model_name
