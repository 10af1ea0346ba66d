"""The benchmark from its command line, as a GPU run uses it: a stopped benchmark leaves no server behind, and a
missing optional package is refused before the first server starts."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from conftest import ROOT, wait_until

BENCHMARK = [sys.executable, "client/benchmark.py"]


def session_members(session: int) -> list[int]:
    """Live (not zombie) processes of this session: a server started by the benchmark leads its own."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it ended while we looked
        state, sid = fields[0], int(fields[3])
        if sid == session and state != "Z":
            members.append(int(stat.parent.name))
    return members


def lines_of(proc: subprocess.Popen) -> "queue.Queue[str]":
    """The process's output lines as they come, read by a thread so that waiting for one has a deadline."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return lines


def wait_for_line(lines: "queue.Queue[str]", marker: str, deadline_s: float) -> str:
    deadline, seen = time.monotonic() + deadline_s, []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        if marker in line:
            return line
    raise AssertionError(f"no line with {marker!r} within {deadline_s} s:\n{''.join(seen)[-3000:]}")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process sessions from /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_benchmark_leaves_no_server_behind(tiny_checkpoint, tmp_path, signum):
    env = {**os.environ, "MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "1024", "PYTHONUNBUFFERED": "1"}
    argv = ["--workload", "saturate", "--numsamples", "400", "--mean-tokens", "400", "--modes", "dynamic,static"]
    proc = subprocess.Popen(
        [*BENCHMARK, *argv, "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # as under `timeout`: the signal reaches the benchmark, not its servers
    )
    try:
        line = wait_for_line(lines_of(proc), "server up at", deadline_s=240)
        url, group = line.split(" at ")[1].split()[0], int(line.rsplit("process group ", 1)[1].rstrip(")\n"))
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        assert session_members(group), "the server runs in its own session"
        wait_until(lambda: requests.get(f"{url}/stats", timeout=10).json().get("requests_running", 0) > 0, 120)
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == 128 + signum
        wait_until(lambda: not session_members(group), deadline_s=20)
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{url}/health", timeout=5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_missing_baseline_package_is_refused_before_any_server_starts(tiny_checkpoint, tmp_path):
    shim = tmp_path / "shim" / "transformers"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('transformers is not installed here')\n")
    # the shim first, before whatever PYTHONPATH already holds (where the other packages may be installed)
    path = os.pathsep.join(filter(None, [str(shim.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "MODEL": str(tiny_checkpoint), "PYTHONPATH": path}
    argv = ["--workload", "saturate", "--numsamples", "2", "--mean-tokens", "2", "--modes", "dynamic"]
    run = subprocess.run(
        [*BENCHMARK, *argv, "--baseline", "transformers-cb", "--out", str(tmp_path / "out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    (message,) = run.stderr.strip().splitlines()  # one line, naming the package and the install command
    assert "transformers" in message and "pip install" in message
    assert "server up" not in run.stdout and not (tmp_path / "out").exists()
