"""The one place a request meets the batching manager: its completions submitted (n per prompt, forks sharing
the prompt), then awaited (`run`) or streamed (`streamed_response`); a refusal, a timeout or a failure as an ApiError.

A request's completions are ordered by prompt, then by n, and `index` is that order. They enter
the batcher together; each is an Inference of its own, with its own text, stop strings and
random stream. With a seed, completion j of a prompt uses seed + j, so each is reproducible
and they differ from each other (and completion 0 is what n = 1 would give).
"""

import queue
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import msgspec
from flask import Response, request

from api.errors import ApiError
from api.generation import Generation, Server
from api.stream_writer import StreamWriter
from batching.admission import Refused
from batching.inference import Delta, Inference
from batching.manager import NotServing
from batching.text_stream import FaultyTextStream, TextStream
from generate.lora_registry import LoraNotFound
from model.tokenizer import EOT_ID

SEED_LIMIT = 2**63
WRITER = StreamWriter()  # this process's writer of streamed responses (each front end has its own)


@dataclass(frozen=True, slots=True)
class Submitted:
    """A request's completions in the manager, by index (prompt, then n)."""

    prompts: list[list[int]]
    completions: list[Inference]
    n: int

    @property
    def usage(self) -> dict:
        """OpenAI's usage: the prompts count once each, whatever n; every completion's tokens count."""
        prompt = sum(len(p) for p in self.prompts)
        generated = sum(len(completion.generated_ids) for completion in self.completions)
        leaders = self.completions[:: self.n]
        cached = sum(leader.seq.num_cached_prompt_tokens or 0 for leader in leaders)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def run(generation: Generation) -> Submitted:
    """The request's completions, submitted and every one answered."""
    submitted = submit(generation, streamed=False)
    wait_all(generation.server, submitted)
    return submitted


def submit(generation: Generation, streamed: bool) -> Submitted:
    """Queue n completions of every prompt (they enter the engine together); the first of each prompt leads,
    the others fork from it. Refused (queue full, a target that cannot be met, not serving): an ApiError."""
    chunks = Chunks() if streamed else None
    params, completions = generation.params, []
    for prompt in generation.prompts:
        leader = None
        for j in range(generation.n):
            own = params if params.seed is None else replace(params, seed=(params.seed + j) % SEED_LIMIT)
            completion = Inference(
                prompt,
                own,
                text=_text_stream(generation, prompt),
                chunks=chunks,
                stream_interval=generation.stream_interval,
                index=len(completions),
                fork_of=leader,
                priority=generation.priority,
                tenant=generation.tenant,
                lora=generation.lora,
            )
            leader = leader or completion
            completions.append(completion)
    try:
        generation.server.manager.enqueue(*completions)
    except Refused as err:
        if err.reason == "failed":  # the engine's process could not take it (ENGINE_PROCESS=on): its own error
            kind = "server_error" if err.status >= 500 else "invalid_request_error"
            raise ApiError(err.status, str(err), kind) from None
        raise ApiError(err.status, str(err), "overloaded", headers={"Retry-After": str(err.retry_after)}) from None
    except NotServing as err:
        raise ApiError(503, str(err), "unavailable") from None
    except LoraNotFound as err:  # the engine in its own process: the adapter was unloaded meanwhile
        raise ApiError(404, str(err), param="model", code="model_not_found") from None
    return Submitted(generation.prompts, completions, generation.n)


def _text_stream(generation: Generation, prompt: list[int]) -> TextStream:
    """A completion's text and stop checker; one that fails in the engine's step where the prompt holds
    FAULT_FAIL_MARKER (fault injection for tests, off by default)."""
    marker, tokenizer = generation.server.settings.fault_fail_marker, generation.server.tokenizer
    faulty = marker and marker in tokenizer.decode(prompt)
    return (FaultyTextStream if faulty else TextStream)(tokenizer, generation.stop)


def wait_all(server: Server, submitted: Submitted) -> None:
    """Every completion answered; past REQUEST_TIMEOUT_S they are aborted (blocks freed) and 504 answered."""
    deadline = time.monotonic() + server.settings.request_timeout_s
    for completion in submitted.completions:
        if not completion.done.wait(max(0.0, deadline - time.monotonic())):
            server.manager.cancel(*submitted.completions)
            break
    for completion in submitted.completions:
        completion.done.wait()
    _raise_error(server, submitted.completions)


def _raise_error(server: Server, completions: Iterable[Inference]) -> None:
    errors = [completion.error for completion in completions if completion.error]
    if "cancelled" in errors:
        raise ApiError(504, f"no answer within {server.settings.request_timeout_s} s", "timeout")
    if errors:
        raise ApiError(500, errors[0], "server_error")


class Chunks:
    """What a streamed request's completions put: each delta, then each completion once answered. Whoever sends
    the request's events takes them from `queue`; the front end's writer also has `waker` called for each."""

    __slots__ = ("queue", "waker")

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Delta | Inference] = queue.SimpleQueue()
        self.waker: Callable[[], None] | None = None

    def put(self, chunk: Delta | Inference) -> None:
        self.queue.put(chunk)
        waker = self.waker
        if waker is not None:
            waker()


class EventStream:
    """A streamed request's server-sent events, made from its chunks as they come: `first` choices, one event per
    delta, the usage if asked, then [DONE]; a completion's error, or no end by REQUEST_TIMEOUT_S, ends it early
    with the error's event. Run by the request's thread (`sse`) or by the front end's writer (api/stream_writer.py);
    whatever has not been answered when it ends, or when its client goes away, is cancelled."""

    def __init__(
        self,
        server: Server,
        submitted: Submitted,
        head: dict,
        render: Callable[[Delta], dict],
        include_usage: bool,
        first: Iterable[dict] = (),
    ):
        self.server, self.submitted, self.head, self.render = server, submitted, head, render
        self.include_usage = include_usage
        self.chunks: Chunks = submitted.completions[0].chunks
        self.pending = len(submitted.completions)
        self.deadline = time.monotonic() + server.settings.request_timeout_s
        self.opening = [event({**head, "choices": [choice]}) for choice in first]
        self.ended = False

    def take(self, chunk: Delta | Inference) -> list[bytes]:
        """The events `chunk` makes: a delta's, or once every completion is answered the last ones."""
        if isinstance(chunk, Delta):
            return [event({**self.head, "choices": [self.render(chunk)]})]
        self.pending -= 1
        try:
            _raise_error(self.server, [chunk])
        except ApiError as err:
            return self._end(err)
        if self.pending:
            return []
        usage = [event({**self.head, "choices": [], "usage": self.submitted.usage})] if self.include_usage else []
        return usage + self._end()

    def timed_out(self) -> list[bytes]:
        return self._end(ApiError(504, f"no answer within {self.server.settings.request_timeout_s} s", "timeout"))

    def _end(self, error: ApiError | None = None) -> list[bytes]:
        self.ended = True
        self.cancel()
        return ([event(error.body())] if error else []) + [b"data: [DONE]\n\n"]

    def cancel(self) -> None:
        unanswered = [completion for completion in self.submitted.completions if not completion.done.is_set()]
        if unanswered:
            self.server.manager.cancel(*unanswered)


def streamed_response(events: EventStream) -> Response:
    """The request's events sent by the front end's writer where it can, else by this request's thread."""
    body = WRITER.body(events, request.environ) or sse(events)
    return Response(body, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})


def sse(events: EventStream) -> Iterator[bytes]:
    """The events, sent by the request's own thread. A client that hangs up closes this generator, which cancels
    the request."""
    try:
        yield from events.opening
        while not events.ended:
            try:
                chunk = events.chunks.queue.get(timeout=max(0.0, events.deadline - time.monotonic()))
            except queue.Empty:
                yield from events.timed_out()
                break
            yield from events.take(chunk)
    finally:
        events.cancel()


_JSON = msgspec.json.Encoder()  # a streamed event's JSON in a sixth of json.dumps' time, compact as vLLM's


def event(payload: dict) -> bytes:
    return b"data: " + _JSON.encode(payload) + b"\n\n"


def text_token_count(completion: Inference, upto: int | None = None) -> int:
    """Generated tokens that make text: all but an ending end-of-text token (which is no text)."""
    count = completion.seq.num_generated if upto is None else upto
    ids = completion.generated_ids
    ended_by_eos = completion.finish_reason == "stop" and completion.params.stop_at_eos and ids and ids[-1] == EOT_ID
    return count - 1 if ended_by_eos and count == len(ids) else count


class NewTokens:
    """Which generated tokens each streamed delta brings, for their log-probabilities."""

    def __init__(self, submitted: Submitted):
        self.submitted = submitted
        self._sent = [0] * len(submitted.completions)

    def take(self, delta: Delta) -> tuple[Inference, int, int]:
        """The delta's completion, and the range of its tokens not reported before."""
        completion = self.submitted.completions[delta.index]
        end = text_token_count(completion, delta.num_tokens) if delta.finish_reason else delta.num_tokens
        start, self._sent[delta.index] = self._sent[delta.index], end
        return completion, start, end


def token_text(server: Server, token: int) -> str:
    return server.tokenizer.decode_single_token_bytes(token).decode("utf-8", errors="replace")
