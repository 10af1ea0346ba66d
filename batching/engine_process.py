"""The engine in a process of its own (ENGINE_PROCESS=on): model, KV cache, scheduler and the batching loop,
fed and read by the front end (batching/engine_client.py) through two ZMQ sockets (messages: batching/wire.py).

In this process the BatchingManager runs exactly as it does in one process: its loop thread builds the engine
and owns every torch op. Each request is rebuilt here as its Inferences, text streams and stop strings included,
so the loop decides every end as before. Two more threads, each blocked in ZMQ (which lets the interpreter go)
when idle: the main thread takes the front end's messages; the sender ships everything ready as one message,
so a step's deltas, one per streaming completion, leave together while the loop runs the next step. No request
thread shares this interpreter: a streamed token costs the loop a few list appends here, its JSON and its
socket write are the front end's.

It exits when the front end sends Stop (after SHUTDOWN_GRACE_S's drain) or when the process that started it is
gone (PR_SET_PDEATHSIG where Linux has it, and a watch on the parent's id).
"""

import contextlib
import ctypes
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from batching import wire
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

NOT_STREAMED = 1 << 30  # a non-streamed completion's stream interval: no delta but its first and last


def run(
    settings: Settings,
    build_engine: Callable[[], Engine],
    tenants: dict[str, tuple[float, int, int]],
    addresses: tuple[str, str],
    parent_pid: int,
) -> None:
    """The process's entry: build the engine, say Ready (or Failed), serve until Stop or the parent's end.
    `tenants`: each keyed tenant's (weight, max waiting, max running)."""
    _exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C reaches the whole group: the front end decides
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(addresses[0])
    outbox.connect(addresses[1])
    core = EngineCore()
    try:
        manager = BatchingManager(build_engine, settings, settled=core.flush)
    except Exception as err:  # noqa: BLE001 - a bad model or setting: the front end says why and stops
        log.exception("the engine could not be built")
        outbox.send(msgspec.msgpack.encode([wire.Failed(f"{type(err).__name__}: {err}")]))
        outbox.close(linger=5000)
        sys.exit(1)
    manager.engine.scheduler.fair.weights.update({name: weight for name, (weight, _, _) in tenants.items()})
    manager.admission.tenants.limits.update(
        {name: (waiting, running) for name, (_, waiting, running) in tenants.items()}
    )
    core.attach(manager)
    manager.start()
    sender = threading.Thread(target=core.send_all, args=(outbox,), name="engine-sender", daemon=True)
    sender.start()
    threading.Thread(target=core.report_status, name="engine-status", daemon=True).start()
    core.outgoing.put(core.ready_message())
    core.serve(inbox)
    sender.join()
    context.destroy(linger=1000)


class EngineCore:
    """The front end's requests, as Inferences in this process's manager; their outputs, as messages."""

    def __init__(self):
        self.tokenizer = load_tokenizer()
        # FromEngine messages, or lists of them (a step's Outs); None: the last has been queued
        self.outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self.outs: list[wire.Out] = []  # the loop's, since it last settled (its thread alone)
        self.requests: dict[int, list[Inference]] = {}  # by the front end's request id, until every one answered

    def attach(self, manager: BatchingManager) -> None:
        self.manager, self.engine = manager, manager.engine

    def flush(self) -> None:
        """The loop has settled: what it handed out since it last did goes to the sender together."""
        if self.outs:
            self.outgoing.put(self.outs)
            self.outs = []

    def ready_message(self) -> wire.Ready:
        engine = self.engine
        loras = [(a.name, a.path, a.id, a.rank) for a in engine.loras.adapters()]
        cache_tokens = engine.blocks.num_blocks * engine.blocks.block_size
        return wire.Ready(engine.model_name, engine.is_random, engine.max_context, cache_tokens, loras)

    def serve(self, inbox: zmq.Socket) -> None:
        """The main thread: each message from the front end, in order, until Stop."""
        decoder = msgspec.msgpack.Decoder(wire.ToEngine)
        while True:
            message = decoder.decode(inbox.recv())
            if isinstance(message, wire.Submit):
                self.outgoing.put(self._submit_or_refuse(message))
            elif isinstance(message, wire.Cancel):
                mine = self.requests.get(message.rid, [])
                self.manager.cancel(*(mine[i] for i in message.indices if i < len(mine)))
            elif isinstance(message, wire.Call):
                self.outgoing.put(self.call(message))
            else:  # Stop: drain as one process does on SIGTERM, then the sender's last message
                self.manager.shut_down(message.grace_s)
                self.manager.join()
                self.outgoing.put(None)
                return

    def _submit_or_refuse(self, request: wire.Submit) -> wire.Ack:
        """One request's trouble here (its constraint failing to compile again, say) is its own answer, never
        the end of this thread."""
        try:
            return self.submit(request)
        except Exception as err:  # noqa: BLE001 - answered to its request alone
            self.requests.pop(request.rid, None)
            status = 400 if isinstance(err, ConstraintError) else 500
            return wire.Ack(request.rid, ("refused", status, f"{type(err).__name__}: {err}", 0, "failed"))

    def submit(self, request: wire.Submit) -> wire.Ack:
        completions: list[Inference] = []
        sink = _Sink(request.rid, completions, request.stream_interval > 0, self)
        lora = self.engine.loras.get(request.lora) if request.lora is not None else None
        if request.lora is not None and lora is None:  # unloaded since the front end looked it up
            return wire.Ack(request.rid, ("missing", 404, f"the model '{request.lora}' does not exist here", 0, ""))
        leader = None
        for index, completion in enumerate(request.completions):
            text = (FaultyTextStream if completion.faulty else TextStream)(self.tokenizer, request.stop)
            inference = Inference(
                completion.prompt_ids,
                self._params(completion.params),
                text=text,
                chunks=sink,
                stream_interval=request.stream_interval or NOT_STREAMED,
                index=index,
                fork_of=leader if completion.forks else None,
                priority=request.priority,
                tenant=request.tenant,
                lora=lora,
            )
            leader = leader if completion.forks else inference
            completions.append(inference)
        self.requests[request.rid] = completions
        try:
            self.manager.enqueue(*completions)
        except Refused as err:
            del self.requests[request.rid]
            return wire.Ack(request.rid, ("refused", err.status, str(err), err.retry_after, err.reason))
        except NotServing as err:
            del self.requests[request.rid]
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
                adapter = loras.load(*call.args)
                return wire.Reply(call.cid, (adapter.name, adapter.path, adapter.id, adapter.rank))
            if call.name == "unload_lora":
                return wire.Reply(call.cid, loras.unload(*call.args))
            return wire.Reply(call.cid, self.manager.report(call.name, *call.args))
        except Exception as err:  # noqa: BLE001 - the caller's error (a 4xx, or its 500), never the engine's end
            return wire.Reply(call.cid, None, (type(err).__name__, str(err)))

    def send_all(self, outbox: zmq.Socket) -> None:
        """The sender thread: everything queued when it wakes, as one message."""
        encoder = msgspec.msgpack.Encoder()
        while True:
            queued = [self.outgoing.get()]
            while True:
                try:
                    queued.append(self.outgoing.get_nowait())
                except queue.Empty:
                    break
            batch = [m for item in queued if item is not None for m in (item if isinstance(item, list) else [item])]
            if batch:
                outbox.send(encoder.encode(batch))
            if queued[-1] is None:
                return

    def report_status(self) -> None:
        while True:
            manager = self.manager
            status = wire.Status(manager.health_problem(), manager.ready, manager.num_waiting(), manager.num_running())
            self.outgoing.put(status)
            time.sleep(wire.STATUS_S)  # a period, not a wait for something: the front end reads the latest


class _Sink:
    """An engine-side request's `chunks`: what BatchingManager hands its client (deltas, then each completion
    once answered) goes to the front end as Out messages, with the tokens each brings."""

    def __init__(self, rid: int, completions: list[Inference], streamed: bool, core: EngineCore):
        self.rid, self.completions, self.streamed, self.core = rid, completions, streamed, core
        self.sent: dict[int, int] = {}  # tokens sent, by completion index
        self.answered = 0

    def put(self, chunk: Delta | Inference) -> None:
        if isinstance(chunk, Delta):
            if self.streamed:
                inference = self.completions[chunk.index]
                delta = (chunk.text, chunk.num_tokens, chunk.finish_reason)
                self.core.outs.append(wire.Out(*self._new(inference, chunk.num_tokens), delta, None))
            return
        seq = chunk.seq
        text = chunk.text.text if chunk.text is not None else ""
        end = wire.End(seq.finish_reason, chunk.error, text, seq.num_cached_prompt_tokens)
        self.core.outs.append(wire.Out(*self._new(chunk, seq.num_generated), None, end))
        self.answered += 1
        if self.answered == len(self.completions):
            self.core.requests.pop(self.rid, None)

    def _new(self, inference: Inference, upto: int) -> tuple[int, int, list[int], list, list]:
        """An Out's first fields: the completion, its tokens and their log-probabilities not sent before (and its
        prompt's, the first time)."""
        seq, first = inference.seq, inference.index not in self.sent
        start = self.sent.get(inference.index, 0)
        self.sent[inference.index] = max(start, upto)
        prompt_logprobs = seq.prompt_logprobs if first else []
        return self.rid, inference.index, inference.generated_ids[start:upto], seq.logprobs[start:upto], prompt_logprobs


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
