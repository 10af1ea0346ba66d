"""One request's life in the server, from arrival to its answer: one Inference per completion it asks for."""

import queue
import threading
import time
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Union

from batching.text_stream import TextStream
from generate.sequence import SamplingParams, Sequence

if TYPE_CHECKING:
    from model.lora import LoraAdapter


class Delta(NamedTuple):
    """What a streaming completion has produced since its last delta."""

    index: int  # which completion of its request
    text: str  # text released since the last delta
    num_tokens: int  # tokens generated so far (their logprobs are on the sequence)
    finish_reason: str | None  # set on the completion's last delta, which always comes


Chunk = Union[Delta, "Inference"]  # a streamed delta, or the inference itself once it has been answered


@dataclass(eq=False)
class Inference:
    prompt_ids: list[int]
    params: SamplingParams
    text: TextStream | None = None  # when the caller wants text (and stop strings) as tokens arrive
    # Streaming: deltas, then this inference once answered, put into what the completions of a request share (a
    # queue, or what has a put: api/submission.py's Chunks, the engine's process's sink)
    chunks: "queue.SimpleQueue[Chunk] | None" = None
    stream_interval: int = 1  # streaming: a delta once this many tokens since the last one (the first goes at once)
    streamed_tokens: int = 0  # tokens up to the last delta
    index: int = 0  # which completion of its request
    fork_of: InitVar["Inference | None"] = None  # a completion of the same prompt added just before this one
    priority: int = 0  # lower is more urgent (generate/priority.py)
    tenant: str = ""  # for fair share between tenants (api/tenants.py)
    lora: "LoraAdapter | None" = None  # the adapter it runs through (the request's "model"); None: the base model
    seq: Sequence = field(init=False)
    done: threading.Event = field(default_factory=threading.Event)  # set exactly once
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # the start of the step that first scheduled it (monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None  # its latest generated token, for the gap to the next one
    finished_at: float | None = None
    error: str | None = None
    # the loop thread's view, for request events: the phase it last recorded, preemptions seen
    phase: str = "waiting"
    preemptions_seen: int = 0

    def __post_init__(self, fork_of: "Inference | None") -> None:
        leader = fork_of.seq if fork_of is not None else None
        self.seq = Sequence(
            list(self.prompt_ids),
            self.params,
            stop=self.text,
            fork_of=leader,
            priority=self.priority,
            tenant=self.tenant,
            lora=self.lora,
        )

    @property
    def generated_ids(self) -> list[int]:
        return self.seq.completion_ids

    @property
    def finish_reason(self) -> str | None:
        return self.seq.finish_reason

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrival

    def stream_due(self) -> bool:
        """Whether its released text may go out now: the first at once (its time to first token), then once
        `stream_interval` tokens have come since the last delta (vLLM's rule); a completion's end always goes."""
        return self.streamed_tokens == 0 or self.seq.num_generated - self.streamed_tokens >= self.stream_interval

    def stream(self, finished: bool) -> None:
        """The text its tokens released, to a streaming client: the first at once, then every `stream_interval`
        tokens, and a completion's last delta always (with its finish reason)."""
        if self.text is None:
            return
        if finished:
            self.text.finish()
        elif not self.stream_due():
            return  # its text waits in the text stream for the next delta
        piece = self.text.take()
        if self.chunks is not None and (piece or finished):
            self.streamed_tokens = num = self.seq.num_generated
            self.chunks.put(Delta(self.index, piece, num, self.finish_reason if finished else None))

    def finish(self, error: str | None = None) -> None:
        """Record that it ended, and when, and why it failed if it did (`error`, or its sequence's: deciding its
        end failed in a step); `answer()` then wakes the request thread."""
        assert self.finished_at is None, "an inference finishes exactly once"
        self.error = error or self.seq.error
        self.finished_at = time.monotonic()

    def answer(self) -> None:
        self.done.set()
        if self.chunks is not None:
            self.chunks.put(self)
