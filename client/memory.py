"""Peak memory of a server's whole process tree, sampled from /proc while it runs (Linux; elsewhere nothing)."""

import threading
from pathlib import Path
from types import TracebackType

from client.cpu import process_tree

PROC = Path("/proc")
# Each sample walks the page tables of every process in the tree (smaps_rollup: ~6 ms for a gpt2 server at rest,
# more under load) on the cores the server computes on. Every 0.25 s that took 0.07-0.09 of 2 cores from the
# server and 1-12 % of its burst's tok/s (Xeon, 2 cores); every 1 s, 0.03 and 1-2 %. A burst lasts many seconds,
# and the last sample comes at the stop.
SAMPLE_EVERY_S = 1.0
MIB = 1024  # /proc reports kB


class PeakMemory:
    """A thread sampling, every SAMPLE_EVERY_S, the memory of `root` and its descendants, summed: the peak RSS and
    the peak PSS. RSS counts a page that forked processes share (a gunicorn master and its worker) once per
    process; PSS splits it between them, so it is the tree's real footprint."""

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
        while True:
            stopping = self._stop.is_set()  # one last sample after the stop: the peaks cover the whole block
            rss, pss = tree_memory_kb(self._root)
            self.rss_kb, self.pss_kb = max(self.rss_kb, rss), max(self.pss_kb, pss)
            if stopping:
                return
            self._stop.wait(SAMPLE_EVERY_S)

    def peaks_mib(self) -> dict[str, float | None]:
        """The peaks so far in MiB; None where /proc gave nothing (not Linux)."""
        return {"rss_mib": self.rss_kb / MIB or None, "pss_mib": self.pss_kb / MIB or None}


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
