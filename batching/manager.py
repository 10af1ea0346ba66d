"""The batching manager: one loop thread owns the engine; request threads wait on events.

The three modes differ only in when requests move from the manager's queue into the
engine, so a comparison between them measures scheduling alone:
  nobatch  one request at a time, start to finish;
  static   when the engine is idle, gather up to MAX_BATCH_SIZE requests (waiting at most
           STATIC_BATCH_WAIT_S for more) and run them until every one is done;
  dynamic  every step, everything waiting is handed to the engine's scheduler, which
           admits it as soon as there is room (iteration-level batching).
A request that asks for several completions (n, or a list of prompts) moves as one: its
inferences enter the engine together, leader first, so forks can share its prompt.
Priorities: dynamic mode hands them to the scheduler, which admits and preempts by them; nobatch
and static take the most urgent requests first (the same rank, generate/priority.py) but never
stop a running batch for one.
What the loop measures goes beside it, to its observer (batching/telemetry/observer.py): one call per step,
one per answer.
The loop's thread also builds the engine: every torch op of the engine (load, warm-up, steps) runs on
that one thread. On a CPU each thread that starts a parallel region gets an OpenMP team of its own, and
with two teams on the cores libgomp stops its workers' spinning between regions (it throttles when it
manages more threads than there are CPUs): a step then waits on woken threads, 17-20 % slower on a
2-core Xeon. Built on the loop's thread, the worker's other threads never start one.
"""

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from itertools import accumulate

from batching.admission import Admission
from batching.inference import Inference
from batching.telemetry.observer import LoopObserver, StepNews
from batching.telemetry.reports import REPORTS
from batching.telemetry.step_summary import StepSummary
from config import Settings
from generate.engine import Engine
from generate.priority import Rank
from generate.sequence import Status
from generate.step_log import StepRecord

log = logging.getLogger(__name__)

IDLE_CHECK_S = 0.5  # idle this long, the loop verifies the KV cache

Settled = Callable[..., None]  # (delivered=()): a step's (inference, token) rows, or none


class NotServing(Exception):
    """The loop is not running (not started yet, or died)."""


class BatchingManager:
    def __init__(
        self,
        build_engine: Callable[[], Engine],
        settings: Settings,
        settled: Settled | None = None,
        before_forward: Callable[[], None] | None = None,
    ):
        """Builds the engine with `build_engine` on the loop's thread (its errors raised here); the loop
        runs from start(). `settled`, if given, is called on the loop's thread whenever it has handed out all it
        had (after each step, with the step's (inference, token) rows; before it sleeps and at its end, with
        none); `before_forward` as each step's forward pass begins (Engine.before_forward). The engine's own
        process makes a step's outputs into messages when it has settled and sends them as the next forward pass
        begins, or at once when the loop has settled with no rows (batching/engine_process.py)."""
        self._settled = settled or (lambda delivered=(): None)
        self._go = threading.Event()  # set by start()
        built: Future[Engine] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(build_engine, before_forward, built), name=f"batching-{settings.mode}", daemon=True
        )
        self._thread.start()
        self.engine = engine = built.result()
        self.settings, self.mode = settings, settings.mode
        self.admission = Admission(settings, engine.scheduler.fair.ledger)
        # what the loop measures goes to one observer; these are its readers' handles
        self.observer = LoopObserver(engine, settings, self.admission, self.num_waiting)
        self.live, self.events = self.observer.live, self.observer.events
        self.stats = self.live.stats  # since-start counts and percentiles
        self.started_at = time.time()  # Unix time, for rates over windows that reach back past the start
        self.failure: str | None = None
        self._stop_at: float | None = None  # set by shut_down()
        self.cache_problem: str | None = None  # from the last idle-time integrity check
        self._cache_checked = False  # since a request last entered the engine (the loop thread's)
        self._hang = threading.Event()  # FAULT_HANG_AT_STEP: the hung step waits for this (set at shutdown)
        self._cond = threading.Condition()
        self._incoming: deque[tuple[Inference, ...]] = deque()  # requests; guarded by _cond
        self._num_incoming = 0  # inferences in _incoming, read without the lock
        self._cancelled: list[Inference] = []  # guarded by _cond
        self._active: dict[int, Inference] = {}  # seq id -> inference; loop thread only

    # --- request threads --------------------------------------------------------------
    def start(self) -> None:
        self._go.set()

    @property
    def ready(self) -> bool:
        return self.failure is None and self._stop_at is None and self._go.is_set() and self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """Serving, or able to again: a loop that died or was stopped never comes back."""
        return self.ready

    def health_problem(self) -> str | None:
        """Why this server cannot serve (its loop died, is stopping, or is stuck in a step), or None."""
        if not self.ready:
            return self.failure or "shutting down"
        return self.observer.heartbeat.stalled(self.num_waiting() + self.num_running())

    def shut_down(self, grace_s: float) -> None:
        """Take no new requests; those not finished within `grace_s` are answered with an error."""
        self._hang.set()
        with self._cond:
            self._stop_at = time.monotonic() + grace_s
            self._cond.notify()

    def join(self) -> None:
        """Wait for the loop to end (after shut_down)."""
        self._thread.join()

    def enqueue(self, *infs: Inference) -> tuple[Inference, ...]:
        """Queue one request's inferences, which enter the engine together and in this order."""
        with self._cond:
            if not self.ready:  # checked under the lock that _fail_everything takes
                raise NotServing(self.failure or ("shutting down" if self._stop_at else "the loop is not running"))
            queued = []  # (priority, prompt tokens) of the requests queued here, when admission weighs work
            if self.admission.counts_work:
                queued = [
                    (inference.priority, len(inference.prompt_ids))
                    for req in self._incoming
                    for inference in _prompts(req)
                ]
            tokens, tenant = sum(len(inference.prompt_ids) for inference in _prompts(infs)), infs[0].tenant
            mine = self.admission.tenants.queued(tenant, self._incoming)
            self.admission.check(tokens, infs[0].priority, self.num_waiting(), queued, tenant, mine, len(infs))
            self._incoming.append(infs)
            self._num_incoming += len(infs)
            for inference in infs:
                self.engine.loras.hold(inference.lora)  # its adapter stays loaded until it is answered
                self.observer.arrived(inference)
            self._cond.notify()
        return infs

    def cancel(self, *infs: Inference) -> None:
        """Stop inferences (their client left or timed out); the loop frees their blocks."""
        with self._cond:
            self._cancelled += infs
            self._cond.notify()

    def num_waiting(self) -> int:
        return self._num_incoming + len(self.engine.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def lora_names(self) -> tuple[list[str], list[str]]:
        """The LoRA adapters of running requests, and of waiting ones (here or in the engine's queue), by name."""
        with self._cond:  # the queue changes under this lock; the engine's lists are copied whole (under the GIL)
            queued = [inference.lora for request in self._incoming for inference in request]
        scheduler = self.engine.scheduler
        waiting = queued + [seq.lora for seq in list(scheduler.waiting)]
        names = lambda loras: sorted({a.name for a in loras if a is not None})  # noqa: E731
        return names(seq.lora for seq in list(scheduler.running)), names(waiting)

    @property
    def steps_done(self) -> int:
        return self.observer.steps_done

    def finished_steps(self) -> list[StepRecord]:
        return self.observer.finished_steps()

    def step_summary(self) -> StepSummary:
        return self.observer.step_summary()

    def report(self, name: str, *args):
        """/stats, /metrics or /stats/timeline's body (batching/telemetry/reports.py), as the engine's process
        answers a Call."""
        return REPORTS[name](self, *args)

    # --- the loop thread --------------------------------------------------------------
    def _run(
        self, build_engine: Callable[[], Engine], before_forward: Callable[[], None] | None, built: Future
    ) -> None:
        try:
            engine = build_engine()
            engine.before_forward = before_forward
            built.set_result(engine)
        except BaseException as err:  # noqa: BLE001 - a bad model or setting: __init__ raises it
            built.set_exception(err)
            return
        self._go.wait()
        try:
            log.info("batching loop running in %s mode", self.mode)
            while not self._stopped():
                self._take_requests()
                self._settled(self._step())
        except BaseException as err:  # the loop must never die silently with requests waiting
            log.exception("batching loop died")
            self._fail_everything(f"the batching loop died: {type(err).__name__}: {err}")
        else:
            self._fail_everything("the server shut down before this request finished")
        self._settled()

    def _stopped(self) -> bool:
        """Shutting down, and its grace over or nothing left to finish (a drained engine's process exits then)."""
        if self._stop_at is None:
            return False
        return time.monotonic() >= self._stop_at or not (self.engine.has_work() or self._incoming)

    def _take_requests(self) -> None:
        """Move requests from the queue into the engine, as the mode allows; sleep when idle."""
        engine = self.engine
        with self._cond:
            self._apply_cancellations()
            if not engine.has_work() and not self._incoming:
                self.admission.publish(engine.scheduler.waiting, engine.scheduler.running)  # nothing left
            while not engine.has_work() and not self._incoming and not self._stopped():
                self.observer.idle()
                self._settled()
                self._wait_for_work()
                self._apply_cancellations()
                self.observer.woke()
            if not self._incoming or (self.mode != "dynamic" and engine.has_work()):
                count = 0  # nobatch and static: nothing joins a running batch
            elif self.mode == "dynamic":
                count = len(self._incoming)
            elif self.mode == "nobatch":
                self._rank_incoming()
                count = 1
            else:
                count = self._gather_static_batch()
            for _ in range(count):
                self._start(self._incoming.popleft())
            self.admission.publish(engine.scheduler.waiting, engine.scheduler.running)

    def _start(self, request: tuple[Inference, ...]) -> None:
        self._cache_checked = False
        self._num_incoming -= len(request)
        for inference in request:
            self._active[inference.seq.seq_id] = inference
            self.engine.add(inference.seq)
            self.observer.admitted(inference)

    def _wait_for_work(self) -> None:
        """Wait (the lock held) to be notified, or for the shutdown's grace to end; the caller checks again what
        there is to do, whatever woke it (a request queued as a timed wait ran out takes its notification with it).
        The KV cache is verified once an idle spell has lasted IDLE_CHECK_S: a large pool's check takes tens of
        milliseconds (65,536 blocks: 10-45 ms), and done as soon as the loop went idle it delayed the request that
        ended a short spell."""
        grace = None if self._stop_at is None else self._stop_at - time.monotonic()
        if self._cache_checked:
            self._cond.wait(timeout=grace)
        elif not self._cond.wait(timeout=IDLE_CHECK_S if grace is None else min(IDLE_CHECK_S, grace)):
            self._check_cache()

    def _check_cache(self) -> None:
        """Verify the KV cache once the server has been idle a while; /stats reports the outcome."""
        self._cache_checked = True  # until a request enters the engine
        try:
            self.engine.blocks.check_integrity(live=[])
            self.cache_problem = None
        except AssertionError as err:
            self.cache_problem = str(err) or "integrity check failed"
            log.error("KV cache integrity: %s", self.cache_problem)

    def _gather_static_batch(self) -> int:
        """Requests for one static batch: up to MAX_BATCH_SIZE inferences (at least one request)."""
        limit = self.settings.engine.max_batch_size
        deadline = self._incoming[0][0].arrival + self.settings.static_batch_wait_s
        while self._num_incoming < limit and time.monotonic() < deadline:
            self._settled()
            self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            self._apply_cancellations()
            if not self._incoming:
                return 0
        self._rank_incoming()
        sizes = accumulate(len(request) for request in self._incoming)
        return max(1, sum(1 for size in sizes if size <= limit))

    def _rank_incoming(self) -> None:
        """nobatch and static: the queue in rank order (a stable sort: equal ranks keep arrival order)."""
        aging = self.settings.engine.priority_aging_s
        rank = lambda request: Rank.of(request[0].priority, request[0].arrival, 0, aging)  # noqa: E731
        self._incoming = deque(sorted(self._incoming, key=rank))

    def _apply_cancellations(self) -> None:
        for inference in self._cancelled:
            if inference.done.is_set():
                continue  # finished (or its whole request cancelled) before the cancellation arrived
            request = next((r for r in self._incoming if inference in r), None)
            if request is not None:  # not started: the whole request leaves the queue
                self._incoming.remove(request)
                self._num_incoming -= len(request)
                for queued in request:
                    self._answer(queued, error="cancelled")
                continue
            self.engine.abort(inference.seq)
            self._active.pop(inference.seq.seq_id, None)
            self._answer(inference, error="cancelled")
        self._cancelled.clear()

    def _step(self) -> list[tuple[Inference, int | None]]:
        """One step, as nano-vllm's LLMEngine.step(): run the engine, deliver, observe, retire. Its rows'
        (inference, token), token None for a prompt chunk short of the prompt's end."""
        began = time.monotonic()
        if self.settings.fault_hang_at_step == self.engine.num_steps + 1:
            self._settled()  # what the steps before it made goes out first
            self._hang.wait()  # fault injection, for tests of /health: this step hangs until shutdown
        results = self.engine.step()  # schedule, run the model, sample, commit (generate/engine.py)
        if not results:
            return []
        news = StepNews(self.engine.step_log.last, began, active=self._active.values(), queued=self._num_incoming)
        for row, (seq, token) in enumerate(results):
            # a sequence's tokens forced by its grammar follow its drawn one (generate/engine.py): it ends with its last
            last = row + 1 == len(results) or results[row + 1][0] is not seq
            self._deliver(self._active[seq.seq_id], token, last and seq.status is Status.FINISHED, news)
        self.observer.on_step(news)  # all the step measured, in one call (batching/telemetry/observer.py)
        for inference in news.finished:
            del self._active[inference.seq.seq_id]
            self._release(inference)
        return news.delivered

    @staticmethod
    def _deliver(inference: Inference, token: int | None, finished: bool, news: StepNews) -> None:
        """A step's token, and the text it released to a streaming client (Inference.stream). Sequences end in
        the engine (Sequence.append decides, stop strings included); here they are only answered."""
        news.delivered.append((inference, token))
        if token is None and not finished:  # a prompt chunk short of the prompt's end
            return
        if finished:
            inference.finish()
            news.finished.append(inference)
        inference.stream(finished)

    def _answer(self, inference: Inference, error: str) -> None:
        """An inference that ends outside a step: cancelled, or failed with the loop (one that ended in
        the step the loop died in keeps its ending)."""
        if inference.finished_at is None:
            inference.finish(error)
        self.observer.on_answer(inference)
        self._release(inference)

    def _release(self, inference: Inference) -> None:
        self.engine.loras.release(inference.lora)
        inference.answer()  # last: whoever the answer reaches finds the request counted everywhere

    def _fail_everything(self, reason: str) -> None:
        with self._cond:
            self.failure = reason
            pending = [inference for request in self._incoming for inference in request] + list(self._active.values())
            self._incoming.clear()
            self._num_incoming = 0
            self._active.clear()
        for inference in pending:
            if not inference.done.is_set():
                self._answer(inference, error=reason)


def _prompts(request: tuple[Inference, ...]) -> list[Inference]:
    """A request's inferences that compute their prompt: all but forks, which share their leader's."""
    return [inference for inference in request if inference.seq.fork_of is None]
