"""What the kept step records say about the loop: how many steps carried a prompt chunk, the
step-time distribution, and where a step's time goes (stage means), so the next bottleneck shows."""

from collections.abc import Iterable
from dataclasses import dataclass

from batching.telemetry.stats import summary
from generate.step_log import STAGES, StepRecord


@dataclass(frozen=True, slots=True)
class StepSummary:
    steps: int  # records summarised (at most STEP_LOG_SIZE)
    steps_with_prefill: int  # of those, steps that computed a prompt chunk
    step_time_s: dict[str, float | None]  # mean, p50, p99 of the whole step, delivery included
    stage_time_s: dict[str, float | None]  # mean seconds per step in each stage (STAGES)

    def as_stats(self) -> dict:
        return {
            "steps": self.steps,
            "steps_with_prefill": self.steps_with_prefill,
            "step_time_s": self.step_time_s,
            "stage_time_s": self.stage_time_s,
        }


def summarize(records: Iterable[StepRecord]) -> StepSummary:
    records = list(records)
    n = len(records)
    stage_totals = dict.fromkeys(STAGES, 0.0)
    for r in records:
        for stage, seconds in r.stages.items():
            stage_totals[stage] = stage_totals.get(stage, 0.0) + seconds
    return StepSummary(
        steps=n,
        steps_with_prefill=sum(1 for r in records if r.num_prefills),
        step_time_s=summary([r.duration_s for r in records]),
        stage_time_s={stage: total / n if n else None for stage, total in stage_totals.items()},
    )
