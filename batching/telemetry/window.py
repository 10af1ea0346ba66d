"""Latency and throughput over the last few seconds, counted when the tokens came, not when requests end.

A request is counted in the window in which each of its tokens was generated: its first token
gives a time to first token (TTFT), each later one a gap since the one before (inter-token
latency, ITL); a request's gaps in the window give its time per output token (TPOT). Tokens of
requests still running count, so the figures move from the first second of a load, however
long its requests. The loop thread records one entry per step; readers take copies.

Tokens are counted exactly; the latency figures are over the window's latest MAX_SAMPLES first
tokens and gaps at most (all of them below ~330 tokens/s in a 30 s window), so that a reading,
once a second from each open page, stays a few milliseconds whatever the token rate.
"""

import threading
from collections import deque
from dataclasses import dataclass

from batching.telemetry.stats import summary

MAX_STEPS = 200_000  # a bound on memory whatever the step rate; the window's time bound comes first
MAX_SAMPLES = 10_000  # latest TTFTs and gaps kept for the percentiles


@dataclass(frozen=True, slots=True)
class StepTokens:
    at: float  # Unix time the step's tokens were delivered
    tokens: int  # generated tokens delivered
    ttfts: tuple[float, ...]  # time to first token of the requests whose first token this is
    gaps: tuple[tuple[int, float], ...]  # (request id, seconds since its previous token), one per later token


class Window:
    def __init__(self, seconds: float, started_at: float) -> None:
        self.seconds, self.started_at = seconds, started_at
        self._steps: deque[tuple[float, int]] = deque(maxlen=MAX_STEPS)  # (Unix time, tokens)
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)  # (Unix time, TTFT)
        # (Unix time, a step's (request, gap) pairs): a step's together, one entry a step rather than one a token
        self._gaps: deque[tuple[float, tuple[tuple[int, float], ...]]] = deque()
        self._num_gaps = 0  # in _gaps, kept to MAX_SAMPLES and a step's more at most
        self._endings: deque[tuple[float, str]] = deque(maxlen=MAX_STEPS)  # (Unix time, event kind)
        self._lock = threading.Lock()

    def add_step(self, entry: StepTokens) -> None:
        at = entry.at
        with self._lock:
            self._steps.append((at, entry.tokens))
            self._ttfts.extend((at, ttft) for ttft in entry.ttfts)
            if entry.gaps:
                self._gaps.append((at, entry.gaps))
                self._num_gaps += len(entry.gaps)
            while self._gaps and self._num_gaps - len(self._gaps[0][1]) >= MAX_SAMPLES:  # the rest hold enough
                self._num_gaps -= len(self._gaps.popleft()[1])
            self._drop_before(at - self.seconds)

    def add_ending(self, at: float, kind: str) -> None:
        with self._lock:
            self._endings.append((at, kind))
            self._drop_before(at - self.seconds)

    def _drop_before(self, start: float) -> None:
        for ring in (self._steps, self._ttfts, self._endings):
            while ring and ring[0][0] < start:
                ring.popleft()
        while self._gaps and self._gaps[0][0] < start:
            self._num_gaps -= len(self._gaps.popleft()[1])

    def figures(self, now: float) -> dict:
        """The window's figures as /stats ("window") and /stats/timeline report them."""
        start = max(now - self.seconds, self.started_at)  # a server younger than the window: its life
        with self._lock:
            tokens = sum(n for at, n in self._steps if at >= start)
            ttfts = [ttft for at, ttft in self._ttfts if at >= start]
            gaps = [pair for at, pairs in self._gaps if at >= start for pair in pairs][-MAX_SAMPLES:]
            endings = [kind for at, kind in self._endings if at >= start]
        per_request: dict[int, list[float]] = {}
        for request, gap in gaps:
            per_request.setdefault(request, []).append(gap)
        span = now - start
        return {
            "seconds": self.seconds,
            "span_s": span,
            "tokens_generated": tokens,
            "output_tokens_per_s": tokens / span if span > 0 else 0.0,
            "first_tokens": len(ttfts),
            "ttft_s": summary(ttfts),
            "itl_s": summary([gap for _, gap in gaps]),
            "tpot_s": summary([sum(gaps) / len(gaps) for gaps in per_request.values()]),
            "requests_finished": endings.count("finished"),
            "requests_failed": endings.count("failed"),
            "requests_cancelled": endings.count("cancelled"),
        }
