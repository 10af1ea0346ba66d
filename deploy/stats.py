"""GET /stats for a cluster: every replica's /stats under its name, and the counts summed; and
GET /dashboard: the replicas, each linked to its own dashboard through the balancer.

HAProxy sends the balancer's /stats here (deploy/haproxy.cfg) over a Unix socket in the
cluster's run directory, so that no replica's numbers pass for the cluster's. Started by
cluster.sh:  python -m deploy.stats SOCKET HOST:PORT [HOST:PORT ...]
"""

import html
import json
import socketserver
import sys
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import requests

# Counts add up over replicas; latencies and rates do not, and stay per replica. The hit rate is
# the cluster's, from the summed token counts.
SUMMED = (
    "requests_completed",
    "requests_failed",
    "requests_running",
    "requests_waiting",
    "tokens_generated",
    "prompt_tokens",
    "prefix_cache_hit_tokens",
    "prefix_cache_query_tokens",
    "kv_blocks_used",
    "kv_blocks_total",
    "kv_blocks_cached",
    "kv_blocks_evictable",
    "evictions",
    "preemptions",
    "steps",
)
TIMEOUT_S = 5.0


def fetch(address: str, headers: dict[str, str]) -> tuple[str, int, dict[str, Any]]:
    """One replica's name (its X-Replica header, else its address), HTTP status and /stats or error."""
    try:
        response = requests.get(f"http://{address}/stats", headers=headers, timeout=TIMEOUT_S)
        body = response.json()
    except (requests.RequestException, ValueError) as exc:
        return address, 503, {"address": address, "error": f"no /stats from {address}: {exc}"}
    return response.headers.get("X-Replica", address), response.status_code, {"address": address, **body}


def aggregate(addresses: list[str], headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """The cluster's status code and /stats: the sums over the replicas that answered, and each one's."""
    with ThreadPoolExecutor(len(addresses)) as pool:
        results = list(pool.map(lambda address: fetch(address, headers), addresses))
    for _, status, body in results:
        if status == 401:  # a missing or wrong API key is the client's error, as one replica says it
            return 401, {"error": body["error"]}
    answered = [body for _, status, body in results if status == 200]
    same = {key: answered[0][key] for key in ("mode", "model") if answered and len({b[key] for b in answered}) == 1}
    sums = {key: sum(body.get(key, 0) for body in answered) for key in SUMMED}
    queried = sums["prefix_cache_query_tokens"]
    return 200, {
        **same,
        **sums,
        # the cluster's: prompt tokens found in some replica's cache, of all admitted to any replica
        "prefix_cache_hit_rate": sums["prefix_cache_hit_tokens"] / queried if queried else 0.0,
        "replicas_answering": len(answered),
        "replicas": {name: body for name, _, body in results},
    }


def dashboard_index(addresses: list[str]) -> str:
    """A page linking each replica's dashboard (/replica/NAME/dashboard on the balancer), and whether it is up."""
    items = []
    for address in addresses:
        try:  # /health names the replica (X-Replica) and needs no API key
            response = requests.get(f"http://{address}/health", timeout=TIMEOUT_S)
            name, state = response.headers.get("X-Replica", address), response.json().get("status", "?")
        except (requests.RequestException, ValueError):
            name, state = address, "not answering"
        link = f'<a href="replica/{html.escape(name)}/dashboard">{html.escape(name)}</a>'
        items.append(f"<li>{link} ({html.escape(state)})</li>")
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Cluster dashboards</title></head>'
        f"<body><h1>Replicas</h1><ul>{''.join(items)}</ul></body></html>"
    )


class StatsHandler(BaseHTTPRequestHandler):
    server: "StatsServer"

    def do_GET(self) -> None:
        path = self.path.partition("?")[0]
        if path == "/dashboard":
            return self._send(200, dashboard_index(self.server.addresses).encode(), "text/html; charset=utf-8")
        if path != "/stats":
            error = {"message": "only /stats and /dashboard", "type": "not_found", "param": None, "code": 404}
            status, body = 404, {"error": error}
        else:
            auth = self.headers.get("Authorization")
            status, body = aggregate(self.server.addresses, {"Authorization": auth} if auth else {})
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        if status == 401:  # as a replica says it: the key goes in a Bearer header
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: HAProxy sees every request, and a Unix socket has no client address to log."""


class StatsServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, socket_path: Path, addresses: list[str]):
        socket_path.unlink(missing_ok=True)  # left by a cluster that was killed
        super().__init__(str(socket_path), StatsHandler)
        self.addresses = addresses


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m deploy.stats SOCKET HOST:PORT [HOST:PORT ...]")
    StatsServer(Path(argv[0]), argv[1:]).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
