"""Where a run's CPU went: the server's processes, HAProxy, this client, and everything else on the machine.

A simulated engine only sleeps, so what limits a simulated cluster on a small machine is the CPU
around it: the replicas' HTTP fronts, the balancer and the client. Linux only (/proc); elsewhere
`sample` returns None and the run records no CPU use.
"""

import os
import time
from pathlib import Path
from typing import NamedTuple

PROC = Path("/proc")
TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


class CpuSample(NamedTuple):
    wall_s: float
    busy_s: float  # all cores together: every CPU second not idle or waiting on I/O
    processes: dict[int, tuple[str, float]]  # pid -> (group, CPU seconds so far)


def sample(server_pid: int | None) -> CpuSample | None:
    """The machine's busy time now, and that of the processes of the server started as `server_pid`
    (with all it started: "haproxy" for HAProxy, "server" for the rest) and of this one ("client")."""
    if not (PROC / "stat").exists():
        return None
    stats = _process_stats()
    processes = {}
    if server_pid is not None:
        for pid in _descendants(server_pid, stats):
            comm, seconds = stats[pid][0], stats[pid][2]
            processes[pid] = ("haproxy" if comm == "haproxy" else "server", seconds)
    if os.getpid() in stats:
        processes[os.getpid()] = ("client", stats[os.getpid()][2])
    return CpuSample(time.monotonic(), _machine_busy_s(), processes)


def usage(before: CpuSample | None, after: CpuSample | None) -> dict[str, float] | None:
    """Average cores busy between two samples: the machine's ("machine"), each group's, and "other"
    (the machine's less the groups': other processes, and the kernel's work for none in particular)."""
    if before is None or after is None:
        return None
    wall = after.wall_s - before.wall_s
    if wall <= 0:
        raise ValueError("the samples are not in order")
    used = {"machine": (after.busy_s - before.busy_s) / wall, "server": 0.0, "haproxy": 0.0, "client": 0.0}
    for pid, (group, seconds) in after.processes.items():
        # a process that started during the run counts from zero; one that ended took its time with it
        used[group] += (seconds - before.processes.get(pid, (group, 0.0))[1]) / wall
    used["other"] = max(0.0, used["machine"] - used["server"] - used["haproxy"] - used["client"])
    return used


def process_tree(root: int) -> list[int]:
    """`root` and every process it started, still running (none if `root` is gone)."""
    return _descendants(root, _process_stats())


def _machine_busy_s() -> float:
    # cpu  user nice system idle iowait irq softirq steal ...: all cores, in clock ticks
    user, nice, system, _idle, _iowait, irq, softirq = map(int, (PROC / "stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) * TICK_S


def _process_stats() -> dict[int, tuple[str, int, float]]:
    """pid -> (command name, parent pid, CPU seconds of all its threads) for every process readable now."""
    stats = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # gone since the listing
            continue
        # pid (comm) state ppid ...; comm may hold spaces and parentheses, so split at the last ')'
        comm = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        stats[int(entry.name)] = (comm, int(fields[1]), (int(fields[11]) + int(fields[12])) * TICK_S)
    return stats


def _descendants(root: int, stats: dict[int, tuple[str, int, float]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (_, parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root] if root in stats else []
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found
