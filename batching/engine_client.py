"""The front end's side of the engine process (ENGINE_PROCESS=on): EngineClient stands where BatchingManager
stands for the API (enqueue, cancel, ready, report, ...), over the engine in a process of its own
(batching/engine_process.py), started with `spawn` so that no CUDA state or lock is ever forked: by this worker
(API_SERVER_COUNT=1), or by gunicorn's master, whose workers are then so many front ends of the one engine.

Its bridge thread, in this process, receives the engine's messages (one per step, carrying every streaming
completion's new tokens and text) and plays each out on the request's own Inference here: tokens appended to
its sequence, a delta on its queue, and at its end the answer that sets its `threading.Event`, so the routes
read a completion exactly as they do in one process. When the engine dies, every request in flight is answered
with an error at once, /health is 503, and its keeper starts a new engine (each restart logged and counted), to
which the bridge connects and says Hello.
"""

import atexit
import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import NamedTuple

import msgspec

from batching import channel, engine_process, wire
from batching.admission_error import Refused
from batching.inference import Inference
from batching.manager import NotServing
from batching.text_stream import FaultyTextStream
from config import EngineSettings, Settings
from generate.constraint_compiler import ConstraintCompiler
from generate.engine import Engine, fit_problem
from generate.lora_registry import LoraInUse, LoraNotFound
from generate.sequence import SamplingParams, Sequence, Status, TokenLogprobs
from model.lora import LoraError
from model.tokenizer import EOT_ID

log = logging.getLogger(__name__)

CALL_ERRORS = {e.__name__: e for e in (LoraError, LoraNotFound, LoraInUse, ValueError)}
CALL_TIMEOUT_S = 10.0  # a report the engine has not answered by then is a 503
STATUS_LATE_S = 2.0  # no status for this long: the engine's process is stuck
CONNECT_S = 0.2  # how soon to try connecting again while no engine listens (one is starting)
SHUT_DOWN = "the server shut down before this request finished"
ENGINE_START_S = 600.0  # gunicorn's master builds the model before any worker starts: this is its margin


class NamedAdapter(NamedTuple):
    """A LoRA adapter as the front end knows it: what the API names and shows (its weights are the engine's)."""

    name: str
    path: str
    id: int
    rank: int


class Adapters:
    """generate.lora_registry.LoraRegistry's face for the API: loads and unloads done by the engine (`call`)."""

    def __init__(self, adapters: list[wire.Adapter], call: Callable):
        self._call = call
        self.refresh(adapters)

    def refresh(self, adapters: list[wire.Adapter]) -> None:
        """The engine's list (a Status's): with several front ends, what another loaded or unloaded."""
        self._by_name = {entry[0]: NamedAdapter(*entry) for entry in adapters}

    def get(self, name: str) -> NamedAdapter | None:
        return self._by_name.get(name)

    def adapters(self) -> list[NamedAdapter]:
        return list(self._by_name.values())

    def load(self, name: str, path: str, root: str | None = None) -> NamedAdapter:
        adapter = self._by_name[name] = NamedAdapter(*self._call("load_lora", name, path, root))
        return adapter

    def unload(self, name: str) -> None:
        self._call("unload_lora", name)
        self._by_name.pop(name, None)


class EngineCard:
    """What the front end knows of the engine without asking it (its Ready message), under Engine's names; and a
    constraint compiler of its own, so that a bad constraint is a 400 here (the engine compiles it again)."""

    def __init__(self, ready: wire.Ready, settings: EngineSettings, call: Callable):
        self.model_name, self.is_random, self.max_context = ready.model_name, ready.is_random, ready.max_context
        self.cache_tokens = ready.cache_tokens
        self.loras = Adapters(ready.loras, call)
        self.constraints = ConstraintCompiler(settings)

    @property
    def max_sequence_tokens(self) -> int:
        return min(self.max_context, self.cache_tokens)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        return fit_problem(num_prompt_tokens, max_tokens, self.max_context, self.cache_tokens)


class EngineClient:
    """The batching manager's interface, over an engine in another process; one bridge thread plays out its
    messages here."""

    def __init__(
        self, settings: Settings, build_engine: Callable[[], Engine], tenants: dict[str, tuple], directory: str = ""
    ):
        """Connect to the engine whose sockets are in `directory` (gunicorn's master keeps it), or with none, start
        one of this worker's own; return once it has answered (a bad model raised here, as RuntimeError)."""
        self.settings, self.mode = settings, settings.mode
        self._keeper = None
        if not directory:
            directory = tempfile.mkdtemp(prefix="engine-")  # the sockets' directory: this user's alone (0700)
            atexit.register(shutil.rmtree, directory, True)
            self._keeper = engine_process.EngineKeeper(settings, build_engine, tenants, directory)
            self._keeper.start()
        self.client = os.getpid()
        self._path = f"{directory}/in"
        self._channel: channel.Channel | None = None  # to the engine serving now; request threads share it
        self._decoder = msgspec.msgpack.Decoder(list[wire.FromEngine])
        self._ids = itertools.count(1)  # request and call ids, never reused (across restarts too)
        self._pending: dict[int, list[Inference]] = {}  # by request id, until every completion is answered
        self._rid: dict[Inference, int] = {}
        self._waiting: dict[int, Future] = {}  # acks and replies, by id
        self._status = wire.Status("the engine process is starting", False, 0, 0, [])  # the engine's latest
        self._status_at = 0.0
        self._stopping = False
        self.failure: str | None = None  # why no engine serves now (restarting)
        ready, after = self._connect(timeout_s=ENGINE_START_S)
        self.engine = EngineCard(ready, settings.engine, self.call)
        self._serving(ready, after)
        self._bridge = threading.Thread(target=self._run, args=(ready,), name=f"batching-{self.mode}-bridge")
        self._bridge.daemon = True
        self._bridge.start()

    # --- request threads --------------------------------------------------------------
    def start(self) -> None:
        """The engine's loop runs from the moment it said Ready."""

    @property
    def ready(self) -> bool:
        return self.failure is None and not self._stopping and self._status.ready

    @property
    def alive(self) -> bool:
        """Serving, or about to again: a dead engine is started again; only shutting down ends it."""
        return not self._stopping

    def health_problem(self) -> str | None:
        if self._stopping:
            return "shutting down"
        if self.failure is not None:
            return self.failure
        if time.monotonic() - self._status_at > STATUS_LATE_S:
            return f"the engine process has not reported for {STATUS_LATE_S:.0f} s"
        return self._status.problem

    def num_waiting(self) -> int:
        return self._status.num_waiting

    def num_running(self) -> int:
        return self._status.num_running

    def enqueue(self, *infs: Inference) -> tuple[Inference, ...]:
        """Send one request's inferences to the engine; its admission's answer raised here (Refused, NotServing)."""
        if not self.ready:
            raise NotServing(self.health_problem() or "the engine is not serving")
        first, rid = infs[0], next(self._ids)
        completions = [
            wire.Completion(
                inference.prompt_ids,
                _params(inference.params),
                inference.seq.fork_of is not None,  # forks from its request's leader before it
                isinstance(inference.text, FaultyTextStream),
            )
            for inference in infs
        ]
        stop = list(first.text.stop_strings) if first.text is not None else []
        lora = first.lora.name if first.lora is not None else None
        self._pending[rid] = list(infs)
        self._rid.update((inference, rid) for inference in infs)
        try:
            streamed = first.chunks is not None
            submit = wire.Submit(self.client, rid, completions, stop, first.priority, first.tenant, lora, streamed)
            refusal = self._ask(rid, submit)
        except NotServing:
            self._forget(rid)
            self._notify(wire.Cancel(self.client, rid, list(range(len(infs)))))  # in case it was queued after all
            raise
        if refusal is not None:
            self._forget(rid)
            kind, status, message, retry_after, reason = refusal
            if kind == "closed":
                raise NotServing(message)
            if kind == "missing":
                raise LoraNotFound(message)
            raise Refused(reason, message, status, retry_after)
        return infs

    def cancel(self, *infs: Inference) -> None:
        by_request: dict[int, list[int]] = {}
        for inference in infs:
            rid = self._rid.get(inference)
            if rid is not None:
                by_request.setdefault(rid, []).append(inference.index)
        for rid, indices in by_request.items():
            self._notify(wire.Cancel(self.client, rid, indices))

    def report(self, name: str, *args):
        """/stats, /metrics or /stats/timeline's body, computed by the engine's process
        (batching/telemetry/reports.py)."""
        return self.call(name, *args)

    def call(self, name: str, *args):
        """What the engine's process answers to a Call; its exception raised here, as the same class where the
        API tells them apart (LoRA loading's), else RuntimeError."""
        cid = next(self._ids)
        value, error = self._ask(cid, wire.Call(self.client, cid, name, list(args)))
        if error is not None:
            kind, message = error
            raise CALL_ERRORS.get(kind, RuntimeError)(message)
        return value

    def shut_down(self, grace_s: float) -> None:
        """SIGTERM: this front end takes no more requests, and those it has get SHUTDOWN_GRACE_S to finish (its
        own engine drains as one process does, then exits); never blocks (a signal handler calls it)."""
        self._stopping = True
        if self._keeper is not None:
            self._keeper.stopping = True
            threading.Thread(target=self._notify, args=(wire.Stop(grace_s),), daemon=True).start()
        else:  # the engine serves other front ends: it keeps running, and forgets this one's requests when it exits
            timer = threading.Timer(grace_s, self._fail_everything, args=(SHUT_DOWN,))
            timer.daemon = True
            timer.start()

    def _ask(self, key: int, message):
        """Send and wait for the engine's answer (an Ack or a Reply)."""
        future: Future = Future()
        self._waiting[key] = future
        self._send(message)
        try:
            return future.result(timeout=CALL_TIMEOUT_S)
        except FutureTimeout:
            raise NotServing("the engine process did not answer") from None
        finally:
            self._waiting.pop(key, None)

    def _send(self, message) -> None:
        """To the engine, from any thread; NotServing where it is gone, or has taken nothing for CALL_TIMEOUT_S."""
        to = self._channel
        if to is None:
            raise NotServing("the engine process is not connected")
        try:
            to.send(msgspec.msgpack.encode(message), CALL_TIMEOUT_S)
        except OSError as err:  # TimeoutError too
            raise NotServing(f"the engine process did not take a message: {err}") from None

    def _notify(self, message) -> None:
        """A message no answer is awaited for (Cancel, Stop): an engine that is gone needs it no more."""
        with contextlib.suppress(NotServing):
            self._send(message)

    def _forget(self, rid: int) -> None:
        for inference in self._pending.pop(rid, []):
            self._rid.pop(inference, None)

    # --- the bridge thread ------------------------------------------------------------
    def _connect(self, timeout_s: float = float("inf")) -> tuple[wire.Ready, list]:
        """Connect to the engine, say Hello and wait for its Ready: one may be starting (its keeper's: none listens
        yet, or one listens that is still building its model), or die while it does. Ready, and what came after it
        in the same read (a Reply to a call a request thread made meanwhile, a Status)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            to = channel.connect(self._path)
            if to is None:
                time.sleep(CONNECT_S)  # nothing to wait on until an engine listens: try again soon
                continue
            with contextlib.suppress(OSError):
                to.send(msgspec.msgpack.encode(wire.Hello(self.client)), CALL_TIMEOUT_S)
                self._channel = to  # request threads' messages follow the Hello
                while (messages := to.receive(CONNECT_S)) is not None and time.monotonic() < deadline:
                    decoded = [m for payload in messages for m in self._decoder.decode(payload)]
                    if decoded:
                        assert isinstance(decoded[0], wire.Ready), decoded[0]  # its first message on a connection
                        return decoded[0], decoded[1:]
            to.close()  # that engine died while starting, or never answered
        self._channel = None
        raise RuntimeError(f"no engine answered within {timeout_s:.0f} s")

    def _serving(self, ready: wire.Ready, after: list) -> None:
        """An engine said Ready: its loop runs, nothing waits yet (its first Status follows within STATUS_S); then
        what it sent after Ready."""
        self.restarts = ready.restarts
        self.engine.loras.refresh(ready.loras)
        self._status, self._status_at = wire.Status(None, True, 0, 0, ready.loras), time.monotonic()
        self.failure = None
        self._apply(after)

    def _run(self, ready: wire.Ready) -> None:
        while True:
            self._serve(ready.pid)
            if self._stopping:
                return
            ready, after = self._connect()
            self._serving(ready, after)
            log.warning("serving again, on engine process %d (%d restart(s) so far)", ready.pid, ready.restarts)

    def _serve(self, pid: int) -> None:
        """Play out the engine's messages until its process ends (its connection closes with it, after the last
        message it sent), then answer every request in flight with an error."""
        frm = self._channel
        assert frm is not None
        while (messages := frm.receive()) is not None:
            for payload in messages:
                self._apply(self._decoder.decode(payload))
        self._channel = None
        frm.close()
        self.failure = SHUT_DOWN if self._stopping else f"the engine process exited (it was process {pid})"
        if not self._stopping:
            log.error("%s: answering every request in flight with an error", self.failure)
        self._fail_everything(self.failure)

    def _apply(self, messages: list) -> None:
        """One message from the engine (what one of its threads had for this front end at once: a step's Tokens,
        or several steps', an Ack, a Reply, a Status). Each step's Tokens are followed by the Ended of the
        completions they end, so a delta is streamed per step, and a completion's last token and its end go out in
        one, as in one process."""
        touched: list[Inference] = []
        for message in messages:
            if isinstance(message, wire.Tokens):
                _stream(touched)  # the step before this one's
                touched = self._tokens(message)
            elif isinstance(message, wire.Ended):
                self._ended(message)
            elif isinstance(message, wire.Status):
                self._status, self._status_at = message, time.monotonic()
                self.engine.loras.refresh(message.loras)
            elif isinstance(message, wire.Ack | wire.Reply):
                future = self._waiting.get(message.rid if isinstance(message, wire.Ack) else message.cid)
                if future is not None:
                    answer = message.refusal if isinstance(message, wire.Ack) else (message.value, message.error)
                    future.set_result(answer)
        _stream(touched)

    def _tokens(self, tokens: wire.Tokens) -> list[Inference]:
        """A step's tokens, each appended to its sequence and its text made here: the completions they went to,
        whose deltas are streamed once the message's ends are known, as BatchingManager does."""
        pending, now, touched = self._pending, time.monotonic(), []
        for rid, index, token in zip(tokens.rids, tokens.indices, tokens.ids):
            completions = pending.get(rid)
            if completions is None:
                continue  # its request was answered already (refused, or failed with an engine that died)
            inference = completions[index]
            _append(inference, [token])
            inference.first_token_at = inference.first_token_at or now
            touched.append(inference)
        for row, entries in tokens.logprobs:
            completions = pending.get(tokens.rids[row])
            if completions is not None:
                completions[tokens.indices[row]].seq.logprobs += _logprobs(entries)
        for row, entries in tokens.prompt_logprobs:
            completions = pending.get(tokens.rids[row])
            if completions is not None:
                completions[tokens.indices[row]].seq.prompt_logprobs = _logprobs(entries)
        return touched

    def _ended(self, ended: wire.Ended) -> None:
        completions = self._pending.get(ended.rid)
        if completions is None:
            return
        inference = completions[ended.index]
        seq = inference.seq
        _append(inference, ended.ids)  # not streamed: what followed its first token
        seq.logprobs += _logprobs(ended.logprobs)
        seq.status, seq.finish_reason = Status.FINISHED, ended.finish_reason
        seq.num_cached_prompt_tokens = ended.num_cached_prompt_tokens
        if ended.prompt_logprobs:
            seq.prompt_logprobs = _logprobs(ended.prompt_logprobs)
        inference.finish(ended.error)
        inference.stream(finished=True)
        inference.answer()
        if all(completion.done.is_set() for completion in completions):
            self._forget(ended.rid)

    def _fail_everything(self, reason: str) -> None:
        for future in list(self._waiting.values()):
            if not future.done():
                future.set_exception(NotServing(reason))
        for rid, completions in list(self._pending.items()):
            for inference in completions:
                if not inference.done.is_set():
                    if inference.finished_at is None:
                        inference.finish(reason)
                    inference.answer()
            self._forget(rid)


def _params(p: SamplingParams) -> wire.Params:
    c = p.constraint.constraint if p.constraint is not None else None
    return wire.Params(
        p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.stop_at_eos, p.logprobs, p.prompt_logprobs,
        p.min_tokens, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, list(p.logit_bias),
        (c.kind, c.spec, c.whitespace_pattern) if c is not None else None,
    )  # fmt: skip


def _stream(touched: list[Inference]) -> None:
    """Deltas due after a step's tokens: an ended completion has streamed its last already."""
    for inference in touched:
        if not inference.done.is_set():
            inference.stream(finished=False)


def _append(inference: Inference, tokens: list[int]) -> None:
    """Tokens to their completion's sequence, and their text (stop strings are the engine's to find, as it decides
    every end; the same text stream finds them here at the same token). Only the last can end it unseen."""
    seq, text = inference.seq, inference.text
    before = seq.num_generated
    seq.token_ids += tokens
    if text is None or not tokens:
        return
    seen = tokens[:-1] if _ends_unseen(seq, tokens[-1]) else tokens
    if not text.stop_strings:
        text.push_many(seen)  # one decode: no stop string's min_tokens to heed token by token
        return
    for generated, token in enumerate(seen, before + 1):
        text.push(token, generated >= seq.params.min_tokens)


def _ends_unseen(seq: Sequence, token: int) -> bool:
    """Whether this token ends its sequence without being text, as Sequence._decide_end has it: end-of-text where
    it may stop (or its grammar ends), which the engine's stop checker never sees either."""
    p = seq.params
    return token == EOT_ID and ((p.stop_at_eos and seq.num_generated >= p.min_tokens) or p.constraint is not None)


def _logprobs(entries: list) -> list[TokenLogprobs]:
    return [TokenLogprobs(logprob, tuple(map(tuple, top))) for logprob, top in entries]
