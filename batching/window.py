"""Latency and throughput over the last few seconds, counted when the tokens came, not when requests end.

A request is counted in the window in which each of its tokens was generated: its first token
gives a time to first token (TTFT), each later one a gap since the one before (inter-token
latency, ITL); a request's gaps in the window give its time per output token (TPOT). Tokens of
requests still running count, so the figures move from the first second of a load, however
long its requests. The loop thread records one entry per step; readers take copies.
"""

import threading
from collections import deque
from dataclasses import dataclass

from batching.stats import summary

MAX_ENTRIES = 200_000  # a bound on memory whatever the step rate; the window's time bound comes first


@dataclass(frozen=True, slots=True)
class StepTokens:
    at: float  # Unix time the step's tokens were delivered
    tokens: int  # generated tokens delivered
    ttfts: tuple[float, ...]  # time to first token of the requests whose first token this is
    gaps: tuple[tuple[int, float], ...]  # (request id, seconds since its previous token), one per later token


class Window:
    def __init__(self, seconds: float, started_at: float) -> None:
        self.seconds, self.started_at = seconds, started_at
        self._steps: deque[StepTokens] = deque(maxlen=MAX_ENTRIES)
        self._endings: deque[tuple[float, str]] = deque(maxlen=MAX_ENTRIES)  # (Unix time, event kind)
        self._lock = threading.Lock()

    def add_step(self, entry: StepTokens) -> None:
        with self._lock:
            self._steps.append(entry)
            self._drop_before(entry.at - self.seconds)

    def add_ending(self, at: float, kind: str) -> None:
        with self._lock:
            self._endings.append((at, kind))
            self._drop_before(at - self.seconds)

    def _drop_before(self, start: float) -> None:
        while self._steps and self._steps[0].at < start:
            self._steps.popleft()
        while self._endings and self._endings[0][0] < start:
            self._endings.popleft()

    def figures(self, now: float) -> dict:
        """The window's figures as /stats ("window") and /stats/timeline report them."""
        start = max(now - self.seconds, self.started_at)  # a server younger than the window: its life
        with self._lock:
            steps = [s for s in self._steps if s.at >= start]
            endings = [kind for at, kind in self._endings if at >= start]
        tokens = sum(s.tokens for s in steps)
        per_request: dict[int, list[float]] = {}
        for s in steps:
            for request, gap in s.gaps:
                per_request.setdefault(request, []).append(gap)
        span = now - start
        return {
            "seconds": self.seconds,
            "span_s": span,
            "tokens_generated": tokens,
            "output_tokens_per_s": tokens / span if span > 0 else 0.0,
            "first_tokens": sum(len(s.ttfts) for s in steps),
            "ttft_s": summary([t for s in steps for t in s.ttfts]),
            "itl_s": summary([gap for gaps in per_request.values() for gap in gaps]),
            "tpot_s": summary([sum(gaps) / len(gaps) for gaps in per_request.values()]),
            "requests_finished": endings.count("finished"),
            "requests_failed": endings.count("failed"),
            "requests_cancelled": endings.count("cancelled"),
        }
