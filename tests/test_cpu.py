"""client.cpu: the CPU a run's processes used, counted by whose they are."""

import subprocess
import sys

import pytest

from client import cpu

BURN_S = 0.5
# Burns BURN_S of CPU time, says so, then waits for its stdin to close.
BURNER = f"""
import sys, time
start = time.process_time()
while time.process_time() - start < {BURN_S}:
    pass
print("burnt", flush=True)
sys.stdin.read()
"""
# A "server" that does nothing itself but start the burner and wait for it: its CPU is its child's.
PARENT = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', sys.argv[1]])"


@pytest.mark.skipif(cpu.sample(None) is None, reason="no /proc")
def test_the_cpu_of_a_servers_descendants_counts_as_the_servers():
    server = subprocess.Popen(
        [sys.executable, "-c", PARENT, BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        before = cpu.sample(server.pid)
        assert server.stdout.readline() == "burnt\n"
        after = cpu.sample(server.pid)
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    used = cpu.usage(before, after)
    wall = after.wall_s - before.wall_s
    # the burn, and at most the two interpreters' start-up besides; /proc counts in clock ticks where the burner
    # timed itself exactly, so the count may fall a tick short of it
    assert BURN_S - cpu.TICK_S <= used["server"] * wall < BURN_S + 0.5
    assert used["haproxy"] == 0 and used["client"] >= 0
    assert used["machine"] * wall >= 0.9 * BURN_S  # the machine was at least that busy (ticks are coarse)
    assert used["other"] == pytest.approx(max(0.0, used["machine"] - used["server"] - used["haproxy"] - used["client"]))


def test_no_samples_no_usage():
    assert cpu.usage(None, None) is None
