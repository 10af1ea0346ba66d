"""CPU time of a running server's threads while a command runs: where its one interpreter's work goes.

    python -m benchmarks.thread_cpu PID -- python client/benchmark.py --url http://127.0.0.1:8500 ...

Reads /proc/PID/task/*/stat before and after COMMAND (Linux only) and prints the command's output, then the
seconds of CPU each of PID's threads used meanwhile: the busiest thread (in a batching server under load, the
engine's loop thread), the others together (gunicorn's request threads, streaming their events) and how many
they were, against the wall time. Python's thread names do not reach /proc, so the busiest thread stands for the
loop: true whenever the loop is the one thread that runs every step.
"""

import argparse
import os
import subprocess
import sys
import time


def thread_cpu_s(pid: int) -> dict[str, float]:
    """Each thread's user + system CPU seconds so far, by thread id."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended between the listing and the read
            continue
        seconds[tid] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14, 15 of stat)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pid", type=int, help="the process whose threads to measure (gunicorn's worker)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run meanwhile")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    before, start = thread_cpu_s(args.pid), time.monotonic()
    rc = subprocess.run(command).returncode
    after, wall = thread_cpu_s(args.pid), time.monotonic() - start
    used = sorted(((s - before.get(tid, 0.0), tid) for tid, s in after.items()), reverse=True)
    busiest, others = used[0] if used else (0.0, "-"), [s for s, _ in used[1:] if s > 0]
    sys.stdout.flush()
    print(
        f"threads of {args.pid} over {wall:.2f} s: busiest (thread {busiest[1]}) {busiest[0]:.2f} s CPU, "
        f"{len(others)} others {sum(others):.2f} s, all {busiest[0] + sum(others):.2f} s"
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
