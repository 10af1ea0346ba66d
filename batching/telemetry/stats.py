"""Since the server started: request counts, token counts, busy time and recent latency percentiles.

Tokens are counted as they are generated (every token, whichever way its request then ends), so
the counts and `throughput_tokens_per_s` move while requests run. Latency percentiles are over
the latest answered requests. The windowed figures, over the last few seconds, are in window.py.
"""

import threading
import time
from collections import deque

from batching.inference import Inference

WINDOW = 10_000  # latest requests kept for percentiles
OUTCOMES = ("ok", "error", "cancelled")


def summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)

    def pct(p: float) -> float:  # linear interpolation between closest ranks
        k = (len(ordered) - 1) * p
        lo = int(k)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": sum(ordered) / len(ordered), "p50": pct(0.5), "p99": pct(0.99)}


def outcome(inference: Inference) -> str:
    return "ok" if inference.error is None else "cancelled" if inference.error == "cancelled" else "error"


class Stats:
    """Thread-safe: the loop thread records, request threads read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.finish_reasons = {"stop": 0, "length": 0}  # of the requests answered "ok"
        self.tokens_generated = self.prompt_tokens = 0
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self._ttft, self._tpot, self._latency, self._latency_per_token = (deque(maxlen=WINDOW) for _ in range(4))

    def mark_busy(self, busy: bool) -> None:
        """Throughput is over wall-clock time with work in the system, not summed latencies."""
        with self._lock:
            now = time.monotonic()
            if busy and self._busy_since is None:
                self._busy_since = now
            elif not busy and self._busy_since is not None:
                self._busy_s += now - self._busy_since
                self._busy_since = None

    def count_tokens(self, prompt: int, generated: int) -> None:
        """Tokens of one step: prompts whose first token came in it, and every token generated."""
        with self._lock:
            self.prompt_tokens += prompt
            self.tokens_generated += generated

    def record(self, inference: Inference) -> None:
        """One answered inference."""
        with self._lock:
            self.outcomes[outcome(inference)] += 1
            if inference.error:
                return
            reason = inference.finish_reason or "length"  # a prompt-only inference ends without generating
            self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
            n = len(inference.generated_ids)
            self._ttft.append(inference.ttft_s)
            self._latency.append(inference.latency_s)
            if n:  # an echo of the prompt alone (max_tokens 0) generates nothing
                self._latency_per_token.append(inference.latency_s / n)
            if n > 1:  # time per output token after the first, as serving benchmarks define it
                self._tpot.append((inference.latency_s - inference.ttft_s) / (n - 1))

    def busy_seconds(self) -> float:
        with self._lock:
            running = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
            return self._busy_s + running

    def finished_reasons(self) -> dict[str, int]:
        """Answered requests by how they ended, as vLLM labels them: stop, length, or abort (cancelled)."""
        with self._lock:
            return {**self.finish_reasons, "abort": self.outcomes["cancelled"]}

    def by_outcome(self) -> dict[str, int]:
        with self._lock:
            return dict(self.outcomes)

    def snapshot(self) -> dict:
        busy = self.busy_seconds()
        with self._lock:
            tokens = self.tokens_generated
            throughput = tokens / busy if busy > 0 else 0.0
            return {
                "requests_completed": self.outcomes["ok"],
                "requests_failed": self.outcomes["error"] + self.outcomes["cancelled"],
                "requests_cancelled": self.outcomes["cancelled"],
                "busy_time_s": busy,
                "throughput_tokens_per_s": throughput,
                "ttft_s": summary(list(self._ttft)),
                "tpot_s": summary(list(self._tpot)),
                "latency_s": summary(list(self._latency)),
                # the keys of the original demo, kept for scripts that read them
                "latency-per-token": summary(list(self._latency_per_token))["mean"] or 0.0,
                "throughput": throughput,
                "total-tokens-handled": tokens,
                "total-elapsed-time": busy,
            }
