"""Admission that protects latency: a request is refused at once, rather than queued into a timeout, when

  queue_full      MAX_WAITING requests already wait (503, Retry-After 1: another replica may have room);
  waiting_tokens  the prompt tokens waiting, its own included, would pass MAX_WAITING_TOKENS (503, likewise);
  ttft_target     with TTFT_TARGET_S set, it could not start in time (429, Retry-After: when it could);
  tenant_*        its tenant is past a limit of its own (429; batching/tenant_limits.py).

Whether it could start in time is an estimate of prefill work alone: the prompt tokens ahead of it
(waiting, or still to compute in running prompts, of its priority or more urgent: less urgent ones
would be preempted for it), plus its own, over the rate at which recent steps have prefilled. A
server that has not prefilled yet has no rate and refuses nothing on this ground. Refusals are counted
by reason for /stats and /metrics, and by tenant (generate/fair_share.py's ledger).
"""

import threading
from collections import deque
from collections.abc import Iterable

from batching.admission_error import Refused
from batching.tenant_limits import REASONS as TENANT_REASONS
from batching.tenant_limits import TenantLimits
from config import Settings
from generate.fair_share import Ledger
from generate.sequence import Sequence

REASONS = ("queue_full", "waiting_tokens", "ttft_target", *TENANT_REASONS)
__all__ = ["Admission", "Refused"]
RATE_STEPS = 32  # recent steps with prefill that the prefill rate is measured over


class Admission:
    """Request threads call `check` under the manager's lock; the loop thread publishes what is waiting
    (under that lock too) and each step's prefill."""

    def __init__(self, settings: Settings, ledger: Ledger | None = None):
        self.max_waiting, self.max_waiting_tokens = settings.max_waiting, settings.max_waiting_tokens
        self.ttft_target_s = settings.ttft_target_s
        # Only the token bound and the TTFT target look at the work waiting: without them, neither the
        # loop (publish, every step) nor a request thread (submit) builds the list.
        self.counts_work = bool(self.max_waiting_tokens or self.ttft_target_s)
        self.refusals = dict.fromkeys(REASONS, 0)
        self.tenants = TenantLimits()  # API_KEYS_FILE's limits, set by the app
        self.ledger = ledger or Ledger()  # refusals by tenant
        self.engine_work: list[tuple[int, int]] = []  # (priority, prompt tokens to compute) in the engine
        self._steps: deque[tuple[int, float]] = deque(maxlen=RATE_STEPS)  # loop thread only
        self._rate: float | None = None  # prefill tokens per second; one assignment, read by any thread
        self._lock = threading.Lock()

    def publish(self, waiting: Iterable[Sequence], running: Iterable[Sequence]) -> None:
        """What the engine has still to prefill, and each tenant's sequences (loop thread, under the manager's lock)."""
        waiting, running = list(waiting), list(running)
        self.tenants.publish(waiting, running)
        if not self.counts_work:
            return
        work = [(s.priority, len(s.token_ids)) for s in waiting]
        work += [(s.priority, s.num_prompt_tokens - s.num_computed_tokens) for s in running]
        self.engine_work = [(p, n) for p, n in work if n > 0]

    def observe_step(self, prefill_tokens: int, duration_s: float) -> None:
        if prefill_tokens and duration_s > 0:
            self._steps.append((prefill_tokens, duration_s))
            self._rate = sum(t for t, _ in self._steps) / sum(d for _, d in self._steps)

    @property
    def prefill_rate(self) -> float | None:
        """Prompt tokens per second over the recent steps that prefilled; None before the first."""
        return self._rate

    def check(
        self,
        prompt_tokens: int,
        priority: int,
        num_waiting: int,
        queued: list[tuple[int, int]],
        tenant: str = "",
        tenant_queued: int = 0,
        count: int = 1,
    ) -> None:
        """Refuse (raise Refused, counted) a request of `count` sequences and `prompt_tokens` at `priority`
        from `tenant`, given the requests waiting, the (priority, prompt tokens) of those queued outside the
        engine, and how many of those are the tenant's."""
        try:
            self.tenants.check(tenant, tenant_queued, count)
            self._check(prompt_tokens, priority, num_waiting, queued + self.engine_work)
        except Refused as refusal:
            with self._lock:
                self.refusals[refusal.reason] += 1
            self.ledger.count_refusal(tenant)
            raise

    def _check(self, prompt_tokens: int, priority: int, num_waiting: int, work: list[tuple[int, int]]) -> None:
        if num_waiting >= self.max_waiting:
            raise Refused("queue_full", f"{self.max_waiting} requests are already waiting", 503, 1)
        waiting_tokens = sum(n for _, n in work) + prompt_tokens
        if self.max_waiting_tokens and waiting_tokens > self.max_waiting_tokens:
            message = f"{waiting_tokens} prompt tokens would be waiting, more than {self.max_waiting_tokens}"
            raise Refused("waiting_tokens", message, 503, 1)
        rate = self._rate
        if not self.ttft_target_s or rate is None:
            return
        ahead = sum(n for p, n in work if p <= priority) + prompt_tokens
        start_s = ahead / rate
        if start_s > self.ttft_target_s:
            message = (
                f"the server could not start this request within the {self.ttft_target_s} s target: "
                f"{ahead} prompt tokens to compute first, about {start_s:.1f} s at {rate:.0f} tokens/s"
            )
            raise Refused("ttft_target", message, 429, start_s - self.ttft_target_s)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.refusals)
