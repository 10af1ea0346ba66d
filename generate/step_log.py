"""What each engine step did and how long its stages took, kept in a bounded ring.

The loop appends one record per step and never waits on readers: /stats, /metrics and the
timeline read copies from other threads, so memory stays constant whatever the uptime.
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

STAGES = ("schedule", "build", "forward", "sample", "deliver")
# and "mask" (waiting for the step's constraint masks, generate/grammar_mask.py) in the steps that had any


class StageClock:
    """Splits one step's wall-clock time into named stages, lap by lap. The runner laps "build" once the step's
    inputs are built, just before its forward pass: `before_forward`, if given, is called then."""

    def __init__(self, before_forward: Callable[[], None] | None = None) -> None:
        self.started_at = time.time()  # wall clock, for timelines
        self._last = self._start = time.perf_counter()
        self.stages: dict[str, float] = {}
        self.before_forward = before_forward

    def lap(self, stage: str) -> None:
        """Charge the time since the previous lap to `stage`."""
        now = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - self._last
        self._last = now
        if stage == "build" and self.before_forward is not None:
            self.before_forward()

    def elapsed(self) -> float:
        return time.perf_counter() - self._start


@dataclass(slots=True)
class StepRecord:
    index: int  # 1 for the engine's first step
    started_at: float  # Unix time
    num_decodes: int  # sequences that computed one generated token
    num_prefills: int  # sequences that computed a prompt chunk (a whole prompt or part of one)
    num_prefill_tokens: int  # prompt tokens computed
    num_sampled: int  # sequences that got a next token
    num_running: int  # after scheduling: admitted, holding blocks
    num_waiting: int  # in the engine's queue
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_free: int
    preemptions: int  # so far, over the engine's life
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage (STAGES)
    duration_s: float = 0.0  # the whole step, delivery to request threads included
    num_queued: int = 0  # waiting in front of the engine, in the batching manager's queue (set at delivery)

    def add_stage(self, stage: str, seconds: float) -> None:
        """Charge a stage that runs after the engine's step (delivery) to this step."""
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds
        self.duration_s += seconds

    def as_dict(self) -> dict:
        return asdict(self)


class StepLog:
    """The last `size` step records, oldest first."""

    def __init__(self, size: int) -> None:
        self._records: deque[StepRecord] = deque(maxlen=size)

    def append(self, record: StepRecord) -> None:
        self._records.append(record)

    @property
    def last(self) -> StepRecord | None:
        try:
            return self._records[-1]  # one indexing, atomic under the GIL (a copy of them all was not needed)
        except IndexError:
            return None

    def since(self, index: int) -> list[StepRecord]:
        """Records of steps after `index` that are still kept, oldest first."""
        return [r for r in self._records.copy() if r.index > index]
