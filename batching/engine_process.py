"""The engine in a process of its own (ENGINE_PROCESS=on): model, KV cache, scheduler and the batching loop,
fed and read by its front ends (batching/engine_client.py: one per gunicorn worker, API_SERVER_COUNT of them),
each over a connection of its own to the engine's Unix socket `in` in a private directory (batching/channel.py;
messages: batching/wire.py), as vLLM's engine core answers each API server on its own socket. EngineKeeper starts
it, and starts another when it dies.

In this process the BatchingManager runs exactly as it does in one process: its loop thread builds the engine
and owns every torch op. Each request is rebuilt here as its Inferences; one with stop strings gets a text stream
to find them, so the loop decides every end as before. Text is the front ends' to make: after each step the loop
hands its rows' token ids to flush(), which makes one Tokens message (columns of numbers) per front end, followed
by the Ended of whatever ended, and sends it to that front end itself as the next step's forward pass begins.
The main thread takes the front ends' messages and answers them (Ready, Ack, Reply); a status thread sends the
Status; a flusher sends what a front end's socket would not take at once (one that has fallen behind). Every send
is the sending thread's own and never blocks it. No request thread shares this interpreter: a streamed token
costs the loop a few list appends here; its text, JSON and socket write are the front end's.

It exits when the front end that started it sends Stop (after SHUTDOWN_GRACE_S's drain) or when the process that
started it is gone (PR_SET_PDEATHSIG where Linux has it, and a watch on the parent's id). A front end that is
gone (its connection closed with its process) has its requests cancelled.
"""

import contextlib
import ctypes
import logging
import multiprocessing
import os
import queue
import select
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing import connection
from multiprocessing.connection import Connection

import msgspec

from batching import channel, wire
from batching.admission_error import Refused
from batching.inference import Delta, Inference
from batching.manager import BatchingManager, NotServing
from batching.text_stream import FaultyTextStream, TextStream
from config import Settings
from generate.constraints import Constraint, ConstraintError
from generate.engine import Engine
from generate.sequence import SamplingParams
from model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

# Where gunicorn's master tells its workers the engine's sockets are (API_SERVER_COUNT > 1: gunicorn.conf.py)
DIRECTORY_VARIABLE = "GPT2_SERVER_ENGINE_DIR"
NOT_STREAMED = 1 << 30  # no delta but its first and last: the front end streams
STOP_FLUSH_S = 1.0  # told to Stop, what the front ends' sockets have not taken yet is sent for up to this long


def run(
    settings: Settings,
    build_engine: Callable[[], Engine],
    tenants: dict[str, tuple[float, int, int]],
    directory: str,
    parent_pid: int,
    restarts: int,
    started: Connection,
) -> None:
    """The process's entry: build the engine, tell its keeper ("ready" or "failed", why) through `started`, then
    serve every front end that says Hello until Stop or the parent's end. `tenants`: each keyed tenant's (weight,
    max waiting, max running); `restarts`: how many engines died before this one."""
    _exit_with_parent(parent_pid)
    # A terminal's ^C, or a SIGTERM to the whole group (cluster.sh stopping its replicas), reaches this process too:
    # the front end decides (it drains, then sends Stop), and this process never outlives its keeper's.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    core = EngineCore(restarts, channel.listen(f"{directory}/in"))  # front ends wait in its backlog meanwhile
    try:
        manager = BatchingManager(build_engine, settings, settled=core.flush, before_forward=core.push)
    except Exception as err:  # noqa: BLE001 - a bad model or setting: the keeper says why
        log.exception("the engine could not be built")
        started.send(("failed", f"{type(err).__name__}: {err}"))
        sys.exit(1)
    manager.engine.scheduler.fair.weights.update({name: weight for name, (weight, _, _) in tenants.items()})
    manager.admission.tenants.limits.update(
        {name: (waiting, running) for name, (_, waiting, running) in tenants.items()}
    )
    core.attach(manager)
    manager.start()
    threading.Thread(target=core.flush_backlogs, name="engine-flusher", daemon=True).start()
    threading.Thread(target=core.report_status, name="engine-status", daemon=True).start()
    started.send(("ready", os.getpid()))
    core.serve()


class EngineKeeper:
    """Starts the engine's process, and starts another whenever it dies, from one thread that lives as long as
    this process: PR_SET_PDEATHSIG fires when the thread that started a child ends, so the engine never outlives
    its keeper's process. The keeper is the one gunicorn worker's (API_SERVER_COUNT=1) or gunicorn's master's
    (more: every worker a front end of the same engine)."""

    def __init__(self, settings: Settings, build_engine: Callable[[], Engine], tenants: dict, directory: str):
        self.recipe = (settings, build_engine, tenants, directory)
        self.restarts = 0
        self.stopping = False  # the engine was told to stop: its end is not a death
        self.process: multiprocessing.Process | None = None
        # gunicorn's master forks its workers after starting the engine: a fork is not the engine's parent, and
        # multiprocessing's exit handler there would terminate the engine it believes its own daemonic child
        os.register_at_fork(after_in_child=multiprocessing.process._children.clear)  # noqa: SLF001

    def stop(self) -> None:
        """The keeper's process is exiting (gunicorn's master, its workers gone): the engine ends with it."""
        self.stopping = True
        if self.process is not None:
            self.process.kill()  # it ignores SIGTERM (run), and has nobody left to answer
            self.process.join(timeout=10)

    def start(self) -> None:
        """Start the first engine and return once it is built; a bad model or setting raised as RuntimeError."""
        first: Future = Future()
        threading.Thread(target=self._keep, args=(first,), name="engine-keeper", daemon=True).start()
        first.result()

    def _keep(self, first: Future) -> None:
        try:
            self.process = self._spawn()
        except RuntimeError as err:
            first.set_exception(err)
            return
        first.set_result(None)
        while True:
            self.process.join()
            if self.stopping:
                return
            pid, code = self.process.pid, self.process.exitcode
            log.error("engine process %d exited (exit code %s): starting another", pid, code)
            self.restarts += 1
            while (process := self._try_spawn()) is None:
                if self.stopping:
                    return
                time.sleep(1.0)  # a pause before the next try, not a wait for an event
            self.process = process
            log.warning("engine process restarted (%d restart(s) so far)", self.restarts)

    def _try_spawn(self) -> multiprocessing.Process | None:
        try:
            return self._spawn()
        except RuntimeError as err:
            log.error("%s; trying again", err)
            return None

    def _spawn(self) -> multiprocessing.Process:
        """One engine process, started with spawn (never a fork of a process that may hold CUDA or OpenMP state),
        once it has said it is built; its failure, or its death before, raised as RuntimeError."""
        spawn = multiprocessing.get_context("spawn")
        ours, theirs = spawn.Pipe(duplex=False)  # the child says "ready" or "failed" on `theirs`
        settings, build_engine, tenants, directory = self.recipe
        args = (settings, build_engine, tenants, directory, os.getpid(), self.restarts, theirs)
        process = spawn.Process(target=run, args=args, name="engine", daemon=True)
        process.start()
        theirs.close()
        log.info("engine process %d started", process.pid)
        connection.wait([ours, process.sentinel])
        try:
            kind, detail = ours.recv()
        except EOFError:
            process.join()
            raise RuntimeError(f"the engine process exited while starting (exit code {process.exitcode})") from None
        if kind == "failed":
            process.join()
            raise RuntimeError(f"the engine could not start: {detail}")
        return process


class EngineCore:
    """The front ends' requests, as Inferences in this process's manager; their outputs, as messages to each."""

    def __init__(self, restarts: int, listener: socket.socket | None = None):
        """`listener`: where front ends connect; with none (a loop run alone, in tests and benchmarks), what would be
        sent is queued in `outgoing` instead, as lists of (front end, FromEngine message)."""
        self.restarts, self.listener = restarts, listener
        self.tokenizer = load_tokenizer()
        self.outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self.ended: list[tuple[int, wire.Ended]] = []  # the loop's, since it last settled (its thread alone)
        self.unsent: dict[int, list] = {}  # the loop's messages since its last push, by front end
        # by front end and its request id, until every completion is answered
        self.requests: dict[tuple[int, int], list[Inference]] = {}
        self.channels: dict[int, channel.Channel] = {}  # each front end's, by its process id, from its Hello
        self.backlogged = threading.Event()  # a channel has some the flusher must send
        self.submitted: dict[int, int] = {}  # requests each front end has submitted
        self.loras_lock = threading.Lock()  # a Status never overtakes the Reply of a load it does not show

    def attach(self, manager: BatchingManager) -> None:
        self.manager, self.engine = manager, manager.engine

    def flush(self, delivered: list[tuple[Inference, int | None]] = ()) -> None:
        """The loop has settled: a step's tokens (`delivered`: its rows' (inference, token)), then what ended, become
        one Tokens message to each front end, followed by their Ended; push() sends them as the next step's forward
        pass begins, or now if the loop has settled with no rows (it is about to sleep or end)."""
        columns: dict[int, wire.Tokens] = {}
        for inference, token in delivered:
            if token is None:
                continue  # a prompt chunk
            sink: _Sink = inference.chunks
            index, seq = inference.index, inference.seq
            position = sink.sent[index]
            if position and not sink.streamed:
                continue  # goes with its Ended
            client, rid = sink.key
            out = columns.get(client) or columns.setdefault(client, wire.Tokens([], [], [], [], []))
            row = len(out.ids)
            out.rids.append(rid)
            out.indices.append(index)
            out.ids.append(token)
            sink.sent[index] = position + 1
            if seq.params.logprobs is not None:
                out.logprobs.append((row, [seq.logprobs[position]]))
            if position == 0 and seq.params.prompt_logprobs is not None:
                out.prompt_logprobs.append((row, seq.prompt_logprobs))
        for client, tokens in columns.items():
            self.unsent.setdefault(client, []).append(tokens)
        for client, ended in self.ended:
            self.unsent.setdefault(client, []).append(ended)
        self.ended = []
        if not delivered:
            self.push()

    def push(self) -> None:
        """What the loop's steps made since the last push, one message to each front end, sent from the loop's
        thread (encoding and sending: a few µs). Called as the next step's forward pass begins, not at flush: the
        front end's thread that a send wakes takes a core then, where at flush it took the loop's own while it
        scheduled and built the next step. Handed to a sender thread instead, a step's messages cost the loop its
        interpreter lock: the sender took it whenever the loop released it in a torch op, and the loop slept until
        it had it back (a 64-stream burst on a 2-vCPU Xeon: 175 such sleeps of 1 ms on average, over 134 steps)."""
        if not self.unsent:
            return
        batches, self.unsent = self.unsent, {}
        for client, batch in batches.items():
            self.post(client, batch)

    def post(self, client: int, messages: list) -> None:
        """Messages to one front end, sent by the calling thread (the loop, the main thread or the status thread);
        what its socket will not take now is the flusher's. A front end that is gone has them dropped."""
        if self.listener is None:
            self.outgoing.put([(client, message) for message in messages])
            return
        to = self.channels.get(client)
        if to is None:
            return
        try:
            if to.send(msgspec.msgpack.encode(messages)):
                self.backlogged.set()
        except OSError:
            pass  # gone: the main thread reads its connection's end

    def ready_message(self) -> wire.Ready:
        engine = self.engine
        cache_tokens = engine.blocks.num_blocks * engine.blocks.block_size
        return wire.Ready(
            os.getpid(), self.restarts, engine.model_name, engine.is_random, engine.max_context, cache_tokens,
            self.adapters(),
        )  # fmt: skip

    def adapters(self) -> list[wire.Adapter]:
        return [(a.name, a.path, a.id, a.rank) for a in self.engine.loras.adapters()]

    def serve(self) -> None:
        """The main thread: front ends connecting, and each one's messages in order, until Stop; a front end's
        connection closing (its process ended) cancels its requests."""
        assert self.listener is not None
        decoder = msgspec.msgpack.Decoder(wire.ToEngine)
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is self.listener:
                    selector.register(channel.Channel(self.listener.accept()[0]), selectors.EVENT_READ)
                    continue
                frm: channel.Channel = key.fileobj  # type: ignore[assignment]
                messages = frm.receive()
                if messages is None:
                    selector.unregister(frm)
                    self._gone(frm)
                    continue
                for message in map(decoder.decode, messages):
                    if isinstance(message, wire.Hello):
                        self._hello(message.client, frm)
                    elif isinstance(message, wire.Submit):
                        self.submitted[message.client] = self.submitted.get(message.client, 0) + 1
                        self.post(message.client, [self._submit_or_refuse(message)])
                    elif isinstance(message, wire.Cancel):
                        mine = self.requests.get((message.client, message.rid), [])
                        self.manager.cancel(*(mine[i] for i in message.indices if i < len(mine)))
                    elif isinstance(message, wire.Call):
                        self.post(message.client, [self.call(message)])
                    else:  # Stop: drain as one process does on SIGTERM, and send what is left
                        self.manager.shut_down(message.grace_s)
                        self.manager.join()
                        self._flush(STOP_FLUSH_S)
                        return

    def _hello(self, client: int, frm: channel.Channel) -> None:
        """A front end: Ready to it, its first message (no Status before it), then everything meant for it."""
        with contextlib.suppress(OSError):  # gone already: its connection's end follows
            backlog = frm.send(msgspec.msgpack.encode([self.ready_message()]))
            self.channels[client] = frm
            if backlog:
                self.backlogged.set()

    def _gone(self, peer: channel.Channel) -> None:
        """A front end's connection closed (its process ended, killed say): nobody waits for its requests any more."""
        peer.close()
        client = next((c for c, known in self.channels.items() if known is peer), None)
        if client is None:
            return  # it never said Hello
        del self.channels[client]
        log.warning("front end %d is gone: cancelling its requests", client)
        self.manager.cancel(*(i for (c, _), infs in list(self.requests.items()) if c == client for i in infs))

    def _submit_or_refuse(self, request: wire.Submit) -> wire.Ack:
        """One request's trouble here (its constraint failing to compile again, say) is its own answer, never
        the end of this thread."""
        try:
            return self.submit(request)
        except Exception as err:  # noqa: BLE001 - answered to its request alone
            self.requests.pop((request.client, request.rid), None)
            status = 400 if isinstance(err, ConstraintError) else 500
            return wire.Ack(request.rid, ("refused", status, f"{type(err).__name__}: {err}", 0, "failed"))

    def submit(self, request: wire.Submit) -> wire.Ack:
        completions: list[Inference] = []
        key = (request.client, request.rid)
        sink = _Sink(key, len(request.completions), request.streamed, self)
        lora = self.engine.loras.get(request.lora) if request.lora is not None else None
        if request.lora is not None and lora is None:  # unloaded since the front end looked it up
            return wire.Ack(request.rid, ("missing", 404, f"the model '{request.lora}' does not exist here", 0, ""))
        leader = None
        for index, completion in enumerate(request.completions):
            # text here only to find stop strings, where the end is decided (the front end renders its own)
            text = TextStream(self.tokenizer, request.stop) if request.stop else None
            inference = Inference(
                completion.prompt_ids,
                self._params(completion.params),
                text=FaultyTextStream(self.tokenizer) if completion.faulty else text,
                chunks=sink,
                stream_interval=NOT_STREAMED,
                index=index,
                fork_of=leader if completion.forks else None,
                priority=request.priority,
                tenant=request.tenant,
                lora=lora,
            )
            leader = leader if completion.forks else inference
            completions.append(inference)
        self.requests[key] = completions
        try:
            self.manager.enqueue(*completions)
        except Refused as err:
            del self.requests[key]
            return wire.Ack(request.rid, ("refused", err.status, str(err), err.retry_after, err.reason))
        except NotServing as err:
            del self.requests[key]
            return wire.Ack(request.rid, ("closed", 503, str(err), 0, ""))
        return wire.Ack(request.rid, None)

    def _params(self, p: wire.Params) -> SamplingParams:
        constraint = self.engine.constraints.compile(Constraint(*p.constraint)) if p.constraint else None
        return SamplingParams(
            p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, p.stop_at_eos, p.logprobs, p.prompt_logprobs,
            p.min_tokens, p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
            tuple(tuple(bias) for bias in p.logit_bias), constraint,
        )  # fmt: skip

    def call(self, call: wire.Call) -> wire.Reply:
        loras = self.engine.loras
        try:
            if call.name == "load_lora":
                with self.loras_lock:
                    adapter = loras.load(*call.args)
                    self._broadcast_status()  # every front end's list of models shows it from now
                return wire.Reply(call.cid, (adapter.name, adapter.path, adapter.id, adapter.rank))
            if call.name == "unload_lora":
                with self.loras_lock:
                    loras.unload(*call.args)
                    self._broadcast_status()
                return wire.Reply(call.cid, None)
            value = self.manager.report(call.name, *call.args)
            if call.name == "stats":  # how the requests spread over the front ends (API_SERVER_COUNT)
                value["front_end_requests"] = sorted(self.submitted.get(client, 0) for client in list(self.channels))
            return wire.Reply(call.cid, value)
        except Exception as err:  # noqa: BLE001 - the caller's error (a 4xx, or its 500), never the engine's end
            return wire.Reply(call.cid, None, (type(err).__name__, str(err)))

    def flush_backlogs(self) -> None:
        """The flusher thread: what a front end's socket would not take when it was sent, as the socket takes it."""
        while True:
            self.backlogged.wait()
            self.backlogged.clear()
            self._flush(float("inf"))

    def _flush(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (waiting := [c for c in list(self.channels.values()) if c.backlog]) and time.monotonic() < deadline:
            poller = select.poll()
            for peer in waiting:
                with contextlib.suppress(ValueError):  # closed meanwhile by the main thread: its front end is gone
                    poller.register(peer, select.POLLOUT)
            poller.poll(1000)
            for peer in waiting:
                with contextlib.suppress(OSError):  # gone: its backlog dropped
                    peer.flush()

    def report_status(self) -> None:
        while True:
            with self.loras_lock:
                self._broadcast_status()
            time.sleep(wire.STATUS_S)  # a period, not a wait for something: the front ends read the latest

    def _broadcast_status(self) -> None:
        manager = self.manager
        status = wire.Status(
            manager.health_problem(), manager.ready, manager.num_waiting(), manager.num_running(), self.adapters()
        )
        for client in list(self.channels):
            self.post(client, [status])


class _Sink:
    """An engine-side request's `chunks`: each completion, once answered, goes to the front end as Ended (its tokens
    go in the steps' Tokens, EngineCore.flush, all or, not streamed, the first; deltas are the front end's to
    make)."""

    def __init__(self, key: tuple[int, int], count: int, streamed: bool, core: EngineCore):
        self.key, self.streamed, self.core = key, streamed, core  # key: (front end, request id)
        self.sent = [0] * count  # tokens sent, by completion index
        self.answered = 0

    def put(self, chunk: Delta | Inference) -> None:
        if isinstance(chunk, Delta):
            return
        seq, index = chunk.seq, chunk.index
        prompt_logprobs = seq.prompt_logprobs if seq.num_generated == 0 else []  # no token carried them
        # Answered in the step that ends it, before that step's flush: whatever the count sent so far, its first
        # token goes (went) with a step, the others here, when it is not streamed.
        rest = [] if self.streamed else seq.completion_ids[1:]
        ended = wire.Ended(
            self.key[1], index, seq.finish_reason, chunk.error, seq.num_cached_prompt_tokens, prompt_logprobs, rest,
            seq.logprobs[1:] if rest and seq.params.logprobs is not None else [],
        )  # fmt: skip
        self.core.ended.append((self.key[0], ended))
        self.answered += 1
        if self.answered == len(self.sent):
            self.core.requests.pop(self.key, None)


def _exit_with_parent(parent_pid: int) -> None:
    """Never outlive the front end: SIGKILL when it dies (Linux), and a watch for a parent gone before that."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the watch below alone
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # it died before the line above
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)  # polling: a parent's exit has no event to wait on in another process
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
