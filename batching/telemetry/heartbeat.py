"""Whether the batching loop still makes progress, for /health: a loop that has died is one failure,
a loop stuck in a step (a hung kernel, a deadlock, a device that stopped answering) is another,
and a load balancer must see both.

The loop beats when it wakes with work and whenever a step finishes. It is stalled when work is
pending and no beat came for longer than the limit: ENGINE_STALL_S, or three times the slowest
step seen if that is longer (a big model on a CPU), or ENGINE_FIRST_STEP_S until the first step
has finished (Triton compiles, CUDA graph capture, weights paged in).
"""

import threading
import time

SLOW_STEP_FACTOR = 3  # a step this many times slower than the slowest yet is no longer just slow


class Heartbeat:
    def __init__(self, stall_s: float, first_step_s: float):
        self.stall_s, self.first_step_s = stall_s, first_step_s
        self._lock = threading.Lock()
        self._beat_at = time.monotonic()
        self._steps = 0
        self._slowest_step_s = 0.0

    def wake(self) -> None:
        """The loop took up work after idling: the wait for it starts now."""
        with self._lock:
            self._beat_at = time.monotonic()

    def step_done(self, duration_s: float) -> None:
        with self._lock:
            self._beat_at = time.monotonic()
            self._steps += 1
            self._slowest_step_s = max(self._slowest_step_s, duration_s)

    def limit_s(self) -> float:
        with self._lock:
            if not self._steps:
                return self.first_step_s
            return max(self.stall_s, SLOW_STEP_FACTOR * self._slowest_step_s)

    def stalled(self, pending: int) -> str | None:
        """Why the loop counts as stuck with `pending` requests in it, or None."""
        limit = self.limit_s()
        with self._lock:
            silent = time.monotonic() - self._beat_at
        if pending and silent > limit:
            return f"the engine loop is stuck: no step finished for {silent:.0f} s with {pending} requests pending"
        return None
