"""Peak memory of a server's whole process tree, sampled from /proc while it runs (Linux; elsewhere nothing)."""

import os
import threading
from pathlib import Path
from types import TracebackType

from client.cpu import process_tree

PROC = Path("/proc")
# smaps_rollup walks a process's page tables (a gpt2 server's whole tree at rest: ~6 ms on a Xeon, 21 ms on a Zen 4;
# more under load) on the cores the server computes on: every 1 s that took 0.03 of 2 cores from the server and
# 1-2 % of its burst's tok/s (Xeon, 2 cores; every 0.25 s, 0.07-0.09 and 1-12 %). So each sample reads each
# process's RSS from statm (a counter, no walk) and walks a process for PSS only when its RSS has grown past its last
# walk's by PSS_WALK_GROWTH, and each once more at the stop. A burst's RSS grows all along as its KV blocks are first
# written, so a 10 s burst still walks the engine's process ~25 times, but the processes around it (gunicorn's
# master and worker: 2.4-2.8 ms a walk against the engine's 10 ms at rest, Zen 4) only at the start and the stop:
# the client of a streamed burst 0.044-0.051 of a core where walking the whole tree at each growth took 0.054-0.057
# (five rounds each). Spacing the walks out saves a little more but misses a process that ends before the stop's
# walk (the offline engine's peak PSS read 2-3 % low with 5 s).
SAMPLE_EVERY_S = 1.0
PSS_WALK_GROWTH = 1.01
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024 if hasattr(os, "sysconf") else 4
MIB = 1024  # /proc reports kB


class PeakMemory:
    """A thread sampling, every SAMPLE_EVERY_S, the memory of `root` and its descendants, summed: the peak RSS and
    the peak PSS. RSS counts a page that forked processes share (a gunicorn master and its worker) once per
    process; PSS splits it between them, so it is the tree's real footprint. Each process's PSS is had at its RSS's
    new highs (within PSS_WALK_GROWTH) and at the stop, and stands until then: a peak of PSS while RSS stays below
    its own is missed, as is a change of PSS alone (pages it shares mapped or dropped by other processes)."""

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
        walked: dict[int, tuple[int, int]] = {}  # each process's RSS at its last walk for PSS, and that PSS
        while True:
            stopping = self._stop.is_set()  # one last sample after the stop: the peaks cover the whole block
            rss = resident_kb(self._root)
            self.rss_kb = max(self.rss_kb, sum(rss.values()))
            for pid, now in rss.items():
                if stopping or pid not in walked or now > walked[pid][0] * PSS_WALK_GROWTH:
                    walked[pid] = (now, pss_kb(pid))
            walked = {pid: walk for pid, walk in walked.items() if pid in rss}  # the processes gone drop out
            self.pss_kb = max(self.pss_kb, sum(pss for _, pss in walked.values()))
            if stopping:
                return
            self._stop.wait(SAMPLE_EVERY_S)

    def peaks_mib(self) -> dict[str, float | None]:
        """The peaks so far in MiB; None where /proc gave nothing (not Linux)."""
        return {"rss_mib": self.rss_kb / MIB or None, "pss_mib": self.pss_kb / MIB or None}


def resident_kb(root: int) -> dict[int, int]:
    """RSS of `root` and each of its descendants now, in kB, by process id, from statm: no walk of their page
    tables."""
    rss = {}
    for pid in process_tree(root) if PROC.exists() else []:
        try:
            rss[pid] = int((PROC / str(pid) / "statm").read_text().split()[1]) * PAGE_KB
        except OSError:  # gone since the listing
            continue
    return rss


def pss_kb(pid: int) -> int:
    """PSS of one process now, in kB (0 if it is gone, or not ours to read): a walk of its page tables."""
    return _rollup(pid).get("Pss", 0)


def tree_memory_kb(root: int) -> tuple[int, int]:
    """RSS and PSS of `root` and its descendants now, summed, in kB."""
    rollups = [_rollup(pid) for pid in (process_tree(root) if PROC.exists() else [])]
    return sum(r.get("Rss", 0) for r in rollups), sum(r.get("Pss", 0) for r in rollups)


def _rollup(pid: int) -> dict[str, int]:
    """smaps_rollup's Rss and Pss of one process, in kB; nothing if it is gone, or not ours to read."""
    try:
        lines = (PROC / str(pid) / "smaps_rollup").read_text().splitlines()
    except OSError:
        return {}
    fields = (line.partition(":") for line in lines)
    return {name: int(value.split()[0]) for name, _, value in fields if name in ("Rss", "Pss")}
