"""What the front door adds to a request's latency: the same server with HAProxy in front
(`HOST=0.0.0.0 ./server.sh dynamic`) and without (`./server.sh dynamic`, gunicorn on loopback).

Both servers run at once with the same settings; requests go to them in turn (A, B, B, A, ...),
one at a time over a kept-alive connection each, so both see the same load from the rest of the
machine. Prints p50 and p90 of a short completion (4 tokens) and of /health, for each, and the
median of the paired differences (front minus direct, the two requests of one round).

    python -m benchmarks.front_door --model random:gpt2 --requests 200
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import requests

from client.launch import running_server

BODY = {"prompt": "The lighthouse keeper", "max_tokens": 4, "temperature": 0}
KINDS = ("completion", "health")


def timed(session: requests.Session, method: str, url: str, **kwargs) -> float:
    start = time.perf_counter()
    response = session.request(method, url, timeout=60, **kwargs)
    elapsed = time.perf_counter() - start
    assert response.status_code == 200, response.text
    return elapsed


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1]


def measure(urls: dict[str, str], rounds: int, warmup: int = 5) -> dict[tuple[str, str], list[float]]:
    """Each round a completion and a /health to each server, in turn, the first server alternating."""
    sessions = {name: requests.Session() for name in urls}  # a kept-alive connection each
    times: dict[tuple[str, str], list[float]] = {(name, kind): [] for name in urls for kind in KINDS}
    for i in range(rounds + warmup):
        for name in list(urls)[:: 1 if i % 2 else -1]:
            completion = timed(sessions[name], "POST", f"{urls[name]}/v1/completions", json=BODY)
            health = timed(sessions[name], "GET", f"{urls[name]}/health")
            if i >= warmup:
                times[name, "completion"].append(completion)
                times[name, "health"].append(health)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--requests", type=int, default=200, help="of each kind, to each server")
    args = parser.parse_args()
    # limits off: the benchmark is one client sending more than the default rate allows
    settings = {"MODEL": args.model, "KV_CACHE_BLOCKS": "512", "LIMIT_REQUESTS": "0", "LIMIT_CONNECTIONS": "0"}
    with (
        tempfile.TemporaryDirectory() as logs,
        running_server("dynamic", Path(logs), HOST="0.0.0.0", RUN_DIR=logs, **settings) as front,
        running_server("dynamic", Path(logs), **settings) as direct,
    ):
        times = measure({"front": front, "direct": direct}, args.requests)
    print(f"{args.requests} requests of each kind to each server, interleaved; model {args.model}")
    print(f"{'':12}{'direct p50':>12}{'front p50':>12}{'paired':>10}{'direct p90':>12}{'front p90':>12}")
    for kind in KINDS:
        direct, front = times["direct", kind], times["front", kind]
        p50 = statistics.median(direct), statistics.median(front)
        p90 = percentile(direct, 90), percentile(front, 90)
        paired = statistics.median(f - d for f, d in zip(front, direct))  # the same round's two requests
        print(
            f"{kind:12}{p50[0] * 1e3:10.2f}ms{p50[1] * 1e3:10.2f}ms{paired * 1e3:8.2f}ms"
            f"{p90[0] * 1e3:10.2f}ms{p90[1] * 1e3:10.2f}ms"
        )


if __name__ == "__main__":
    main()
