"""Start the real ./server.sh (gunicorn) on a free port and wait for /health, with a deadline."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
HEALTH_DEADLINE_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MODE", "PORT", "HOST")}
    # server.sh runs the python of the active environment: make it this one.
    env["VIRTUAL_ENV"] = sys.prefix
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env.update(settings)
    return env


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, deadline_s: float = HEALTH_DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)  # polling interval, not synchronisation: the loop has a deadline
    raise TimeoutError(f"server not healthy within {deadline_s} s:\n{log.read_text()[-3000:]}")


def start_server(mode: str, log_dir: Path, **settings: str) -> tuple[subprocess.Popen, str]:
    """./server.sh MODE on a free port, healthy; its process (a session leader) and its URL."""
    port = free_port()
    log = log_dir / f"server-{mode}-{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(ROOT / "server.sh"), mode],
            cwd=ROOT,
            env=server_env(PORT=str(port), **settings),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
    except BaseException:
        stop_server(proc)
        raise
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def running_server(mode: str, log_dir: Path, **settings: str) -> Iterator[str]:
    proc, url = start_server(mode, log_dir, **settings)
    try:
        yield url
    finally:
        stop_server(proc)
