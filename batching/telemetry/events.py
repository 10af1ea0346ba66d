"""Each request's phase changes, kept in a bounded ring beside the engine's step log.

A request is *waiting* from its arrival in the batching manager's queue until the manager
hands it to the engine (static and nobatch modes hold it there while a batch runs; dynamic
hands it over at the next step); then *admitted* (in the engine's queue, or back there after
a preemption) until a step schedules it; in *prefill* while its prompt (or, after a
preemption, its whole context) is computed, then *decoding* from the token that ends the
prefill, until it ends: finished, failed or cancelled. Request threads record arrivals, the
loop thread everything else; readers get copies, so memory stays constant whatever the uptime
and the loop never waits on them.
"""

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

# Event kind -> the phase it starts (None: the request has ended).
PHASE_AFTER = {
    "arrived": "waiting",
    "admitted": "admitted",
    "preempted": "admitted",
    "prefill": "prefill",
    "decoding": "decoding",
    "finished": None,
    "failed": None,
    "cancelled": None,
}
ENDINGS = ("finished", "failed", "cancelled")


@dataclass(slots=True)
class RequestEvent:
    index: int  # 1 for the server's first event; consecutive, in the order events were recorded
    at: float  # Unix time
    request: int  # the request's id (its sequence id), the same in all its events
    kind: str  # a key of PHASE_AFTER
    prompt_tokens: int
    generated_tokens: int  # so far
    # structured output: the constraint's kind (generate/constraints.py KINDS) on every event of a
    # constrained request, so a reader that missed its arrival (ring, late page) still knows; else None
    constraint: str | None = None
    lora: str | None = None  # the LoRA adapter's name on every event of a request that runs through one
    ttft_s: float | None = None  # on "finished": time to first token
    latency_s: float | None = None  # on "finished": arrival to the last token
    tenant: str = ""  # whose request it is: kept to show a tenant its own events only, never shown

    def as_dict(self) -> dict:
        shown = asdict(self)
        del shown["tenant"]
        return shown


class EventLog:
    """The last `size` request events, oldest first."""

    def __init__(self, size: int) -> None:
        self._events: deque[RequestEvent] = deque(maxlen=size)
        # Two threads record (a request thread its arrival, the loop the rest): the lock keeps
        # indices consecutive in ring order, so `since` paging never skips one.
        self._lock = threading.Lock()
        self._count = 0

    def record(
        self,
        request: int,
        kind: str,
        prompt_tokens: int,
        generated_tokens: int,
        at: float | None = None,
        constraint: str | None = None,
        lora: str | None = None,
        tenant: str = "",
        **ending: float | None,
    ) -> None:
        assert kind in PHASE_AFTER, kind
        with self._lock:
            self._count += 1
            at = time.time() if at is None else at
            event = RequestEvent(
                self._count, at, request, kind, prompt_tokens, generated_tokens, constraint, lora, **ending
            )
            event.tenant = tenant
            self._events.append(event)

    @property
    def count(self) -> int:
        """Events recorded over the server's life (the index of the latest one)."""
        return self._count

    def since(self, index: int) -> list[RequestEvent]:
        """Events after `index` that are still kept, oldest first."""
        with self._lock:
            events = self._events.copy()
        return [e for e in events if e.index > index]
