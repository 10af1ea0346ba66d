"""Per-tenant admission limits (API_KEYS_FILE's max_waiting and max_running, api/tenants.py): a request
is refused at once, 429 with Retry-After, when

  tenant_max_waiting  its tenant's sequences waiting, its own included, would pass max_waiting;
  tenant_max_running  its tenant already has max_running sequences running.

Sequences, not requests: one asking for n completions counts n. Waiting counts those queued in the
manager and in the scheduler's queue, as the loop last published them.
"""

from collections import Counter
from collections.abc import Iterable

from batching.admission_error import Refused
from generate.sequence import Sequence

REASONS = ("tenant_max_waiting", "tenant_max_running")


class TenantLimits:
    def __init__(self) -> None:
        self.limits: dict[str, tuple[int | None, int | None]] = {}  # tenant -> (max waiting, max running)
        self._waiting: Counter[str] = Counter()  # in the scheduler, as last published (loop thread)
        self._running: Counter[str] = Counter()

    def publish(self, waiting: Iterable[Sequence], running: Iterable[Sequence]) -> None:
        """The scheduler's sequences by tenant (loop thread, under the manager's lock); only with limits set."""
        if self.limits:
            self._waiting = Counter(s.tenant for s in waiting)
            self._running = Counter(s.tenant for s in running)

    def queued(self, tenant: str, requests: Iterable[tuple]) -> int:
        """The tenant's inferences among `requests` (the manager's queue); 0 without limits to check."""
        return sum(len(r) for r in requests if r[0].tenant == tenant) if self.limits else 0

    def check(self, tenant: str, queued: int, count: int) -> None:
        """Refuse `count` sequences of `tenant`, with `queued` of its sequences queued outside the engine."""
        max_waiting, max_running = self.limits.get(tenant, (None, None))
        waiting = queued + self._waiting[tenant] + count
        if max_waiting is not None and waiting > max_waiting:
            message = f"tenant {tenant!r} would have {waiting} requests waiting, more than its {max_waiting}"
            raise Refused("tenant_max_waiting", message, 429, 1)
        if max_running is not None and self._running[tenant] >= max_running:
            message = f"tenant {tenant!r} already has {self._running[tenant]} requests running, its limit"
            raise Refused("tenant_max_running", message, 429, 1)
