"""What the batching loop measures, beside the loop rather than through it.

The loop tells the observer what happened, once per step (`on_step`) and once per answered
inference (`on_answer`), plus the few moments between steps (an arrival, an admission, idling and
waking); the observer fans each out to its readers: the request events (events.py), the live
table (live.py: since-start counts, histograms, the window), the heartbeat (/health's hang
detection), admission's measured prefill rate, and the step's record (its delivery stage, and when
it is final). Readers on other threads take copies; nothing here waits on them.

Each inference's timestamps (first token, latest token, first scheduled) are set here too, as its
tokens are observed, before its answer wakes the request thread that reads them.
"""

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import partial

from batching.admission import Admission
from batching.inference import Inference
from batching.telemetry.events import PHASE_AFTER, EventLog
from batching.telemetry.heartbeat import Heartbeat
from batching.telemetry.live import LiveTable
from batching.telemetry.step_summary import StepSummary, summarize
from config import Settings
from generate.engine import Engine
from generate.engine_counters import counters
from generate.step_log import StepRecord


@dataclass(slots=True)
class StepNews:
    """What one engine step did, as the loop saw it while delivering."""

    record: StepRecord  # the engine's record of the step
    began: float  # monotonic time the loop started the step
    delivered: list[tuple[Inference, int | None]] = field(default_factory=list)  # (inference, token or None)
    finished: list[Inference] = field(default_factory=list)  # ended in this step (`finish()`ed, not answered)
    active: Collection[Inference] = ()  # every inference the engine held in the step
    queued: int = 0  # inferences still in the manager's queue (nobatch and static keep them there)
    started: float = field(default_factory=time.perf_counter)  # when delivery began, for its stage time
    # monotonic time of the step's tokens (taken before any of its inferences finished)
    at: float = field(default_factory=time.monotonic)


class LoopObserver:
    def __init__(self, engine: Engine, settings: Settings, admission: Admission, num_waiting: Callable[[], int]):
        self.step_log, self.admission = engine.step_log, admission
        self.live = LiveTable(
            partial(counters, engine),
            engine.model_name,
            engine.max_sequence_tokens,
            settings.timeline_window_s,
            num_waiting,
            admission.counts,
        )
        self.events = EventLog(settings.request_event_log_size)
        self.heartbeat = Heartbeat(settings.engine_stall_s, settings.engine_first_step_s)
        # The last step whose record is final (delivery charged): readers of the step log stop
        # there, since the loop still fills in the record of the step it is running.
        self.steps_done = 0
        self._preemptions_seen = 0  # the engine's count as of the last step's record; loop thread only

    # --- between steps -----------------------------------------------------------------------------
    def arrived(self, inference: Inference) -> None:
        """On the request thread: the inference joined the manager's queue."""
        self._record(inference, "arrived")

    def admitted(self, inference: Inference) -> None:
        """Handed to the engine, whose scheduler will run it when there is room."""
        self._record(inference, "admitted")

    def idle(self) -> None:
        """The loop is about to wait for work: throughput counts busy time only."""
        self.live.stats.mark_busy(False)

    def woke(self) -> None:
        """The loop took up work after waiting: the heartbeat's wait for a step starts now."""
        self.heartbeat.wake()
        self.live.stats.mark_busy(True)

    # --- each step ---------------------------------------------------------------------------------
    def on_step(self, news: StepNews) -> None:
        """The step's tokens, phase changes and answers counted, then its record made final."""
        step = news.record
        self.heartbeat.step_done(step.duration_s)
        self.admission.observe_step(step.num_prefill_tokens, step.duration_s)
        # the record's count is the scheduler's once this step was scheduled: a step launched ahead preempts none
        if step.preemptions != self._preemptions_seen:
            self._record_preemptions(news.active, step)
        self._count_tokens(news)
        for inference in news.finished:  # after the tokens: an answer finds its tokens in /stats
            self.on_answer(inference)
        step.num_queued = news.queued
        step.add_stage("deliver", time.perf_counter() - news.started)
        self.steps_done = step.index

    def _count_tokens(self, news: StepNews) -> None:
        now = news.at
        tokens, firsts, gaps = 0, [], []
        for inference, token in news.delivered:
            if inference.phase != "decoding":  # one check per sequence and step: most are decoding
                self._record_prefill(inference, token, news)
            if token is None and inference.finished_at is None:  # a prompt chunk short of the prompt's end
                continue
            if inference.first_token_at is None:
                inference.first_token_at = now  # for a prompt-only inference: its prompt's log-probabilities
                firsts.append(inference)
            elif token is not None:
                gaps.append((inference.seq.seq_id, now - inference.last_token_at))
            if token is not None:
                tokens += 1
                inference.last_token_at = now
        self.live.tokens_delivered(tokens, firsts, gaps)

    def _record_prefill(self, inference: Inference, token: int | None, news: StepNews) -> None:
        """The step that first schedules a waiting request starts its prefill; its first token ends it."""
        if inference.phase == "admitted":  # as of the step's start, before its token (if any) was appended
            if inference.scheduled_at is None:
                inference.scheduled_at = news.began
            generated = len(inference.generated_ids) - (token is not None)
            self._record(inference, "prefill", at=news.record.started_at, generated=generated)
        if token is not None:  # the token that ends a prefill (or a recomputation after a preemption)
            self._record(inference, "decoding")

    def _record_preemptions(self, active: Collection[Inference], step: StepRecord) -> None:
        """Preempted sequences went back to the queue while this step was scheduled."""
        self._preemptions_seen = step.preemptions
        for inference in active:
            if inference.seq.num_preemptions != inference.preemptions_seen:
                inference.preemptions_seen = inference.seq.num_preemptions
                self._record(inference, "preempted", at=step.started_at)

    # --- each answer -------------------------------------------------------------------------------
    def on_answer(self, inference: Inference) -> None:
        """An inference ended (`inference.finish()` done) and is about to be answered."""
        self.live.answered(inference)
        if inference.error is None:
            self._record(inference, "finished", ttft_s=inference.ttft_s, latency_s=inference.latency_s)
        else:
            self._record(inference, "cancelled" if inference.error == "cancelled" else "failed")

    def _record(
        self,
        inference: Inference,
        kind: str,
        at: float | None = None,
        generated: int | None = None,
        **ending: float | None,
    ) -> None:
        """A request event (now, unless `at`); `inference.phase` follows it (the loop's view of the request)."""
        generated = len(inference.generated_ids) if generated is None else generated
        constraint = inference.seq.params.constraint
        constraint_kind = constraint.constraint.kind if constraint is not None else None
        lora = inference.lora.name if inference.lora is not None else None
        self.events.record(
            inference.seq.seq_id,
            kind,
            inference.seq.num_prompt_tokens,
            generated,
            at,
            constraint_kind,
            lora,
            inference.tenant,
            **ending,
        )
        inference.phase = PHASE_AFTER[kind] or kind

    # --- readers (request threads) -----------------------------------------------------------------
    def finished_steps(self) -> list[StepRecord]:
        """Kept step records whose figures are final (not the running step's), oldest first."""
        done = self.steps_done  # read first: records up to here are no longer written
        return [r for r in self.step_log.since(0) if r.index <= done]

    def step_summary(self) -> StepSummary:
        return summarize(self.finished_steps())
