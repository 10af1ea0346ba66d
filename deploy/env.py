"""The settings server.sh and cluster.sh need, read as every replica reads its own (environment, then .env).

Printed as shell assignments for the scripts to eval, so that one parser, config.Settings, and
one set of defaults serve the front door, the balancer and the replicas alike.
  python -m deploy.env          the assignments
  python -m deploy.env --warn   and, on stderr, what exposing HOST this way risks (cluster.sh, once)
"""

import os
import shlex
import shutil
import sys
from pathlib import Path

from config import SPARE_THREADS, Settings

MARGIN_S = 60  # the balancer waits this much longer than a replica, which answers its own timeout
NO_LIMIT = 2**31 - 1  # a limit of 0: HAProxy compares against a count no client reaches


def haproxy_path() -> str:
    """HAPROXY, else haproxy on PATH or in the sbin directories a user's PATH may lack; empty if none."""
    path = f"{os.environ.get('PATH', '')}:/usr/sbin:/usr/local/sbin"
    return os.environ.get("HAPROXY") or shutil.which("haproxy", path=path) or ""


def front_values(settings: Settings) -> dict[str, object]:
    """The front door's settings in HAProxy's terms (deploy/haproxy.cfg's ${CLUSTER_*} variables)."""
    front = settings.front_door
    if front.tls_cert and not Path(front.tls_cert).is_file():
        raise ValueError(f"TLS_CERT: no file {front.tls_cert!r} (a PEM holding the certificate and its key)")
    return {
        "tls_cert": str(Path(front.tls_cert).resolve()) if front.tls_cert else "",
        "read_timeout": f"{round(front.request_read_timeout_s * 1000)}ms",
        "queue_timeout": f"{round(front.queue_timeout_s * 1000)}ms",
        # the request line and headers must fit a buffer less the room HAProxy keeps for rewriting them
        "bufsize": front.max_header_bytes + 1024,
        # a replica is sent no more requests at once than its threads less the spares, which stay free for
        # HAProxy's health checks (not counted) whatever holds the others; the rest wait in HAProxy's queue
        "replica_maxconn": settings.server_threads - SPARE_THREADS,
        # per-client limits, where the front door listens beyond this machine
        "limits": "on" if settings.exposed else "off",
        "limit_connections": front.limit_connections or NO_LIMIT,
        "limit_requests": front.limit_requests or NO_LIMIT,
        "limit_period": front.limit_period_s,
        "limit_by": front.limit_by,
    }


def main(argv: list[str]) -> None:
    try:
        settings = Settings.from_env()
        values = {
            "host": settings.host,
            "port": settings.port,
            "block_size": settings.engine.block_size,
            "timeout": f"{int(settings.request_timeout_s) + MARGIN_S}s",
            "device": settings.engine.device,
            "engine": settings.engine.engine,
            "replica": settings.replica,
            "front": "on"
            if settings.front_door.front == "auto" and (settings.exposed or settings.front_door.tls_cert)
            else "off",
            "haproxy": haproxy_path(),
            **front_values(settings),
        }
    except ValueError as err:
        sys.exit(f"error: {err}")
    # cluster.sh's own variables, and the GPUs to share out; load_dotenv has put .env's there too.
    # SERVER_FRONT: set by server.sh, whose front door fronts its one server as if there were no balancer.
    for name in ("REPLICAS_AT", "RUN_DIR", "BALANCE", "CUDA_VISIBLE_DEVICES", "SERVER_FRONT"):
        values[name.lower()] = os.environ.get(name, "")
    if "--warn" in argv:
        for warning in settings.exposure_warnings(front=True):
            print(f"warning: {warning}", file=sys.stderr)
    print("\n".join(f"{name}={shlex.quote(str(value))}" for name, value in values.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
