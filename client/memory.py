"""Peak memory of a server's whole process tree, sampled from /proc while it runs (Linux; elsewhere nothing)."""

import os
import threading
from pathlib import Path
from types import TracebackType

from client.cpu import process_tree

PROC = Path("/proc")
# smaps_rollup walks the page tables of every process in the tree (~6 ms for a gpt2 server at rest, more under load)
# on the cores the server computes on: every 1 s that took 0.03 of 2 cores from the server and 1-2 % of its burst's
# tok/s (Xeon, 2 cores; every 0.25 s, 0.07-0.09 and 1-12 %). So each sample reads the tree's RSS from statm (a
# counter, no walk) and walks for PSS only when RSS has grown past the last walk's by PSS_WALK_GROWTH, and once
# more at the stop. A burst's RSS grows all along as its KV blocks are first written, so a 10 s burst still walks
# ~25 times (the client 0.035 of a core in a non-streamed burst). Spacing the walks out saves a little more but
# misses a process that ends before the stop's walk (the offline engine's peak PSS read 2-3 % low with 5 s).
SAMPLE_EVERY_S = 1.0
PSS_WALK_GROWTH = 1.01
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024 if hasattr(os, "sysconf") else 4
MIB = 1024  # /proc reports kB


class PeakMemory:
    """A thread sampling, every SAMPLE_EVERY_S, the memory of `root` and its descendants, summed: the peak RSS and
    the peak PSS. RSS counts a page that forked processes share (a gunicorn master and its worker) once per
    process; PSS splits it between them, so it is the tree's real footprint. PSS is had at RSS's new highs (within
    PSS_WALK_GROWTH) and at the stop: a peak of PSS while RSS stays below its own is missed."""

    def __init__(self, root: int):
        self._root = root
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)
        self.rss_kb = 0
        self.pss_kb = 0

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *_exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        walked_at = 0  # the tree's RSS at the last walk for PSS
        while True:
            stopping = self._stop.is_set()  # one last sample after the stop: the peaks cover the whole block
            rss = resident_kb(self._root)
            self.rss_kb = max(self.rss_kb, rss)
            if stopping or rss > walked_at * PSS_WALK_GROWTH:
                walked_at = rss
                self.pss_kb = max(self.pss_kb, tree_memory_kb(self._root)[1])
            if stopping:
                return
            self._stop.wait(SAMPLE_EVERY_S)

    def peaks_mib(self) -> dict[str, float | None]:
        """The peaks so far in MiB; None where /proc gave nothing (not Linux)."""
        return {"rss_mib": self.rss_kb / MIB or None, "pss_mib": self.pss_kb / MIB or None}


def resident_kb(root: int) -> int:
    """RSS of `root` and its descendants now, summed, in kB, from statm: no walk of their page tables."""
    total = 0
    for pid in process_tree(root) if PROC.exists() else []:
        try:
            total += int((PROC / str(pid) / "statm").read_text().split()[1]) * PAGE_KB
        except OSError:  # gone since the listing
            continue
    return total


def tree_memory_kb(root: int) -> tuple[int, int]:
    """RSS and PSS of `root` and its descendants now, summed, in kB."""
    rss = pss = 0
    if not PROC.exists():
        return rss, pss
    for pid in process_tree(root):
        try:
            lines = (PROC / str(pid) / "smaps_rollup").read_text().splitlines()
        except OSError:  # gone since the listing, or not ours to read
            continue
        for line in lines:
            name, _, value = line.partition(":")
            if name == "Rss":
                rss += int(value.split()[0])
            elif name == "Pss":
                pss += int(value.split()[0])
    return rss, pss
