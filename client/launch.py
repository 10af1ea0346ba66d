"""Start the real ./server.sh (gunicorn), or ./cluster.sh, on a free port and wait for /health, with a deadline."""

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
HEALTH_DEADLINE_S = 300
PORTS_FROM = 10000  # servers started here listen at or above this port
# On a signal every server gets this long to stop before it is killed: `timeout --kill-after=10` kills the
# benchmark itself 10 s after its TERM, and a server left behind would hold the GPU's memory for the next run.
STOP_ON_SIGNAL_S = 6.0

_started: dict[int, subprocess.Popen] = {}  # every server started here and not yet stopped, by process id


def free_port(following: int = 0) -> int:
    """A free port, and `following` free ports after it (a cluster's replicas listen there).

    Drawn below the kernel's ephemeral range: a port in it can be taken by any outgoing connection
    before the server binds it, or by the health probe itself, which then connects to its own port.
    """
    below = _ephemeral_start()
    while True:
        port = random.randrange(PORTS_FROM, below - following)
        if all(_is_free(port + i) for i in range(following + 1)):
            return port


def _ephemeral_start() -> int:
    """The first port the kernel gives outgoing connections (Linux's setting), else IANA's dynamic range."""
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        if low - PORTS_FROM > 1000:
            return low
    return 49152


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def server_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MODE", "PORT", "HOST")}
    # server.sh runs the python of the active environment: make it this one.
    env["VIRTUAL_ENV"] = sys.prefix
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env.update(settings)
    return env


def wait_healthy(
    url: str, proc: subprocess.Popen, log: Path, deadline_s: float = HEALTH_DEADLINE_S, verify: str | bool = True
) -> None:
    """Poll /health until 200; `verify`: the certificate to trust for https (requests' verify)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/health", timeout=2, verify=verify).status_code == 200:
                return
        time.sleep(0.2)  # polling interval, not synchronisation: the loop has a deadline
    raise TimeoutError(f"server not healthy within {deadline_s} s:\n{log.read_text()[-3000:]}")


def start_server(mode: str, log_dir: Path, port: int | None = None, **settings: str) -> tuple[subprocess.Popen, str]:
    """./server.sh MODE on `port` (default: a free one), healthy; its process (a session leader) and its URL.
    Exposed (HOST=0.0.0.0) it runs its front door there, and the server itself on port + 1."""
    port = port or free_port(following=1)
    return start_command([str(ROOT / "server.sh"), mode], log_dir / f"server-{mode}-{port}.log", port, **settings)


def start_cluster(args: list[str], log_dir: Path, **settings: str) -> tuple[subprocess.Popen, str]:
    """./cluster.sh ARGS (N MODE, or none with REPLICAS_AT) on a free port, healthy through HAProxy."""
    port = free_port(following=int(args[0]) if args else 0)
    return start_command([str(ROOT / "cluster.sh"), *args], log_dir / f"cluster-{port}.log", port, **settings)


def start_command(command: list[str], log: Path, port: int, **settings: str) -> tuple[subprocess.Popen, str]:
    """Any HTTP server listening on `port` with a /health route (./server.sh, ./cluster.sh, a peer's server),
    started in its own session with `settings` in its environment, output to `log`, stopped by a signal as
    stop_all_on_signal says; healthy: its process and its URL."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=server_env(PORT=str(port), **settings),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _started[proc.pid] = proc
    # TLS_CERT: the front door speaks HTTPS with that certificate (self-signed in tests), trusted here
    url = f"{'https' if settings.get('TLS_CERT') else 'http'}://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, verify=settings.get("TLS_CERT") or True)
    except BaseException:
        stop_server(proc)
        raise
    return proc, url


def stop_server(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """TERM to the server's process group (it runs in its own session), KILL after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _started.pop(proc.pid, None)


def stop_all_on_signal() -> Callable[[], None]:
    """From now on SIGTERM and SIGINT stop every server started here, then end this process at once with
    128 + the signal's number; the returned function puts the previous handlers back.

    A server runs in its own session, so the signal that `timeout` or Ctrl-C sends this process's group
    never reaches it. The process ends without unwinding: its request threads may wait on a server that
    is gone, and every finished run's results are already on disk.
    """

    def handler(signum: int, _frame: object) -> None:
        signal.signal(signum, signal.SIG_IGN)  # one orderly stop, however many signals
        print(f"\n{signal.Signals(signum).name}: stopping {len(_started)} server(s)", file=sys.stderr, flush=True)
        procs = list(_started.values())
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        # Polled, not waited on: the signal may have come while this thread held a Popen's wait lock.
        deadline = time.monotonic() + STOP_ON_SIGNAL_S
        while time.monotonic() < deadline and any(proc.poll() is None for proc in procs):
            time.sleep(0.1)
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: a worker may outlive its master
        sys.stdout.flush()
        os._exit(128 + signum)

    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for signum, action in previous.items():
            signal.signal(signum, action)

    return restore


@contextlib.contextmanager
def running_server(mode: str, log_dir: Path, **settings: str) -> Iterator[str]:
    proc, url = start_server(mode, log_dir, **settings)
    try:
        yield url
    finally:
        stop_server(proc)
