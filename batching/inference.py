"""One request's life in the server, from arrival to its answer."""

import queue
import threading
import time
from dataclasses import dataclass, field

from batching.text_stream import TextStream
from generate.sequence import SamplingParams, Sequence


@dataclass(eq=False)
class Inference:
    prompt_ids: list[int]
    params: SamplingParams
    text: TextStream | None = None  # when the caller wants text (and stop strings) as tokens arrive
    chunks: "queue.SimpleQueue[str | None] | None" = None  # streaming: text pieces, then None
    seq: Sequence = field(init=False)
    done: threading.Event = field(default_factory=threading.Event)  # set exactly once
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    # the loop thread's view, for request events: the phase it last recorded, preemptions seen
    phase: str = "waiting"
    preemptions_seen: int = 0

    def __post_init__(self) -> None:
        self.seq = Sequence(list(self.prompt_ids), self.params)

    @property
    def generated_ids(self) -> list[int]:
        return self.seq.completion_ids

    @property
    def finish_reason(self) -> str | None:
        return "stop" if self.text is not None and self.text.stopped else self.seq.finish_reason

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrival

    def finish(self, error: str | None = None) -> None:
        """Record that it ended, and when; `answer()` then wakes the request thread."""
        assert self.finished_at is None, "an inference finishes exactly once"
        self.error = error
        self.finished_at = time.monotonic()

    def answer(self) -> None:
        self.done.set()
        if self.chunks is not None:
            self.chunks.put(None)
