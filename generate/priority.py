"""Which request goes first: its priority (an integer, lower is more urgent, as vLLM's), then its arrival.

A sequence's rank is fixed when it is added to the scheduler (its arrival). With aging
(PRIORITY_AGING_S > 0) it is its arrival time plus PRIORITY_AGING_S seconds for each level of
priority: a request that has waited that long ranks with a newcomer one level more urgent, so
every request, however low its priority, in time outranks everything that arrives after it, and
nothing starves. Without aging (0), priority first, then arrival, strictly: a stream of urgent
requests can then hold a less urgent one back for ever. Equal priorities keep first-come order
either way; the last tie-break is the order of adding.
"""

from typing import NamedTuple


class Rank(NamedTuple):
    level: float  # aging: arrival + priority * aging; strict: the priority
    arrival_s: float
    order: int  # the order of adding, for sequences that arrived at the same instant

    @classmethod
    def of(cls, priority: int, arrival_s: float, order: int, aging_s: float) -> "Rank":
        if aging_s > 0:
            return cls(arrival_s + priority * aging_s, arrival_s, order)
        return cls(float(priority), arrival_s, order)
