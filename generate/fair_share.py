"""Fair share between tenants: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024), adapted to chunked prefill and batch seats.

Each tenant (an API key's, a request's `user`, or the shared one: api/tenants.py) has a counter of
the service it has had, in weighted tokens over the tenant's weight:
  + FAIR_SHARE_INPUT_WEIGHT x the prompt tokens the server computes for a sequence, charged when it is
    first admitted (tokens from the prefix cache or shared with a fork's leader cost nothing, and the
    recomputation after a preemption is not charged: the tenant did not ask for it);
  + FAIR_SHARE_OUTPUT_WEIGHT x each generated token, charged in the step that samples it.
Among the waiting sequences of the head's priority (priorities and aging choose the head first), the
scheduler admits the oldest of the tenant whose counter is smallest. A tenant with nothing in the
scheduler that gets a sequence is lifted to the smallest counter of the tenants that have some (to
the last one's to leave, when none has): idle time is not banked, so a tenant coming back cannot
take the server until the others catch up. The bound this gives is derived in docs/fairness.md.

The counters (and the per-tenant figures of the ledger) are kept whether FAIR_SHARE is on or off;
only the order of admission reads them, and only when it is on.
"""

import threading
from collections import Counter

SHARED = ""  # the tenant of requests that name none
SHARED_LABEL = "shared"  # ... as /stats and /metrics show it
OTHER = "other"  # the label of tenants past the cap
MAX_LABELS = 32  # distinct tenant labels in /stats and /metrics


class Ledger:
    """Per-tenant figures for /stats and /metrics, under at most MAX_LABELS labels (tenants seen later
    count as "other", so a `user` per end user cannot blow up a Prometheus server). Written by the loop
    thread (served tokens) and request threads (refusals), read by any."""

    def __init__(self, max_labels: int = MAX_LABELS):
        self.max_labels = max_labels
        self._labels: dict[str, str] = {}
        self._lock = threading.Lock()
        self.prompt_tokens: Counter[str] = Counter()
        self.generated_tokens: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()

    def label(self, tenant: str) -> str:
        with self._lock:
            found = self._labels.get(tenant)
            if found is None:
                if len(self._labels) >= self.max_labels:
                    return OTHER
                found = self._labels[tenant] = SHARED_LABEL if tenant == SHARED else tenant
            return found

    def label_of(self, tenant: str) -> str | None:
        """The tenant's own label, if it has one (not "other", which several share); assigns none."""
        with self._lock:
            return self._labels.get(tenant)

    def served(self, tenant: str, prompt_tokens: int, generated_tokens: int) -> None:
        label = self.label(tenant)
        with self._lock:
            self.prompt_tokens[label] += prompt_tokens
            self.generated_tokens[label] += generated_tokens

    def count_refusal(self, tenant: str) -> None:
        label = self.label(tenant)
        with self._lock:
            self.refused[label] += 1

    def read(self, counts: Counter[str]) -> dict[str, int]:
        with self._lock:
            return dict(counts)

    def tally(self, tenants: list[str]) -> dict[str, int]:
        """How many of `tenants` (one entry per sequence) fall under each label."""
        return dict(Counter(self.label(t) for t in tenants))


class FairShare:
    """The tenants' counters; the scheduler (loop thread) calls every method but `weight`'s readers."""

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0):
        assert input_weight >= 0 and output_weight >= 0
        self.input_weight, self.output_weight = input_weight, output_weight
        self.weights: dict[str, float] = {}  # tenant -> its weight (1 if absent): from the keys file
        self.counters: dict[str, float] = {}  # every active tenant's, and idle ones' above the floor
        self.active: Counter[str] = Counter()  # tenant -> its sequences in the scheduler
        self._last_left = 0.0  # the counter of the last tenant to become idle
        self.ledger = Ledger()

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def floor(self) -> float:
        """What a tenant becoming active is lifted to: never decreases (see _forget_idle)."""
        return min((self.counters[t] for t in self.active), default=self._last_left)

    def arrive(self, tenant: str) -> None:
        """A sequence of `tenant` enters the scheduler."""
        if not self.active[tenant]:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), self.floor())
        self.active[tenant] += 1

    def leave(self, tenant: str) -> None:
        """A sequence of `tenant` leaves the scheduler (finished or aborted)."""
        assert self.active[tenant] > 0
        self.active[tenant] -= 1
        if not self.active[tenant]:
            del self.active[tenant]
            self._last_left = self.counters[tenant]
            self._forget_idle()

    def _forget_idle(self) -> None:
        """An idle tenant whose counter is at or below the floor would be lifted to the floor on its
        return, so its counter says nothing more: forget it (the table stays about as small as the set of
        active tenants, even with a tenant per end user). The floor never decreases: counters only grow,
        a newcomer starts at the floor, and a tenant leaving takes itself out of the minimum."""
        floor = self.floor()
        for tenant in [t for t, c in self.counters.items() if c <= floor and t not in self.active]:
            del self.counters[tenant]

    def charge(self, tenant: str, prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
        assert self.active[tenant] > 0, "only a tenant with sequences in the scheduler is served"
        cost = self.input_weight * prompt_tokens + self.output_weight * generated_tokens
        self.counters[tenant] += cost / self.weight(tenant)
        self.ledger.served(tenant, prompt_tokens, generated_tokens)

    def service(self, tenant: str) -> float:
        return self.counters[tenant]

    def pick(self, waiting: list, priority: int):
        """Of the waiting sequences (in rank order) at `priority`, the first of the least-served tenant;
        among tenants with equal counters, the one whose sequence ranks first."""
        best, best_service, seen = None, float("inf"), set()
        for seq in waiting:
            if seq.priority != priority or seq.tenant in seen:
                continue
            seen.add(seq.tenant)
            service = self.counters[seq.tenant]
            if service < best_service:
                best, best_service = seq, service
            if len(seen) == len(self.active):
                break  # every tenant with a sequence has been seen
        assert best is not None, "the head of the queue has this priority"
        return best
