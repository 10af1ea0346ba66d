"""Server-wide counters and latency distributions, as /stats reports them."""

import threading
import time
from collections import deque

from batching.inference import Inference

WINDOW = 10_000  # latest requests kept for percentiles


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


class Stats:
    """Thread-safe: the loop thread records, request threads read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.completed = self.failed = self.tokens_generated = self.prompt_tokens = 0
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

    def record(self, inf: Inference) -> None:
        with self._lock:
            if inf.error:
                self.failed += 1
                return
            n = len(inf.generated_ids)
            self.completed += 1
            self.tokens_generated += n
            self.prompt_tokens += len(inf.prompt_ids)
            self._ttft.append(inf.ttft_s)
            self._latency.append(inf.latency_s)
            if n:  # an echo of the prompt alone (max_tokens 0) generates nothing
                self._latency_per_token.append(inf.latency_s / n)
            if n > 1:  # time per output token after the first, as serving benchmarks define it
                self._tpot.append((inf.latency_s - inf.ttft_s) / (n - 1))

    def busy_seconds(self) -> float:
        with self._lock:
            running = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
            return self._busy_s + running

    def snapshot(self) -> dict:
        busy = self.busy_seconds()
        with self._lock:
            latency = list(self._latency)
            tokens = self.tokens_generated
            throughput = tokens / busy if busy > 0 else 0.0
            return {
                "requests_completed": self.completed,
                "requests_failed": self.failed,
                "tokens_generated": tokens,
                "prompt_tokens": self.prompt_tokens,
                "busy_time_s": busy,
                "throughput_tokens_per_s": throughput,
                "ttft_s": summary(list(self._ttft)),
                "tpot_s": summary(list(self._tpot)),
                "latency_s": summary(latency),
                # the keys of the original demo, kept for scripts that read them
                "latency-per-token": summary(list(self._latency_per_token))["mean"] or 0.0,
                "throughput": throughput,
                "total-tokens-handled": tokens,
                "total-elapsed-time": busy,
            }
