"""Serving under overload, against a running server (./server.sh dynamic):

  mixed     a saturating batch load (closed loop, --batch-clients) beside interactive requests at a
            steady rate; phases: interactive alone (idle), batch alone (its capacity), both with the
            batch at priority 1000 (priorities on), both with everything at priority 0 (off)
  overload  open-loop arrivals at --rate requests/s (set it to about twice capacity, with the server's
            TTFT_TARGET_S set): admitted requests' TTFT against the target, refusals and their speed

Prints one JSON line per phase; checks that nothing is lost and that the KV pool ends where it began.
  python -m benchmarks.overload --url http://127.0.0.1:8680 mixed --duration 60
"""

import argparse
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

WORDS = "the keeper watched ships pass a storm at night while gulls cried over grey water and rocks".split()


def prompt(rng: random.Random, words: int) -> str:
    return f"{rng.randrange(10**9)} " + " ".join(rng.choice(WORDS) for _ in range(words))


def send(url: str, text: str, tokens: int, priority: int) -> dict:
    started = time.monotonic()
    body = {"prompt": text, "num_tokens": tokens, "temperature": 0, "priority": priority}
    response = requests.post(f"{url}/inference", json=body, timeout=900)
    answer = response.json() if response.headers.get("Content-Type", "").startswith("application/json") else {}
    return {"status": response.status_code, "seconds": time.monotonic() - started, **answer}


def pct(values: list[float], p: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else None


def run_phase(url: str, args, batch_priority: int | None, interactive: bool) -> dict:
    """Batch clients (None: none) and interactive arrivals for args.duration seconds; their results."""
    stop, results, rng = threading.Event(), {"batch": [], "interactive": []}, random.Random(1)

    def batch_client(seed: int) -> None:
        local = random.Random(seed)
        while not stop.is_set():
            results["batch"].append(send(url, prompt(local, args.batch_words), args.batch_tokens, batch_priority))

    batch_clients = args.batch_clients if batch_priority is not None else 0
    with ThreadPoolExecutor(batch_clients + 256) as pool:
        clients = [pool.submit(batch_client, i) for i in range(batch_clients)]
        sent, started = [], time.monotonic()
        while time.monotonic() - started < args.duration:
            if interactive:
                sent.append(pool.submit(send, url, prompt(rng, args.words), args.tokens, 0))
            time.sleep(rng.expovariate(args.rate))  # Poisson arrivals: the load's own clock
        stop.set()
        results["interactive"] = [f.result() for f in sent]
        for f in clients:
            f.result()
    elapsed = time.monotonic() - started
    inter, batch = results["interactive"], results["batch"]
    return {
        "interactive": len(inter),
        "interactive_failed": sum(r["status"] not in (200, 429, 503) for r in inter),
        "interactive_refused": sum(r["status"] in (429, 503) for r in inter),
        "refusal_seconds_max": max([r["seconds"] for r in inter if r["status"] in (429, 503)], default=None),
        "interactive_ttft_p50_s": pct([r["ttft_s"] for r in inter if r["status"] == 200], 0.5),
        "interactive_ttft_p99_s": pct([r["ttft_s"] for r in inter if r["status"] == 200], 0.99),
        "batch": len(batch),
        "batch_failed": sum(r["status"] != 200 for r in batch),
        "batch_tokens_per_s": sum(r.get("completion_tokens", 0) for r in batch) / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8500")
    parser.add_argument("scenario", choices=["mixed", "overload"])
    parser.add_argument("--duration", type=float, default=60, help="seconds of each phase")
    parser.add_argument("--rate", type=float, default=0.5, help="interactive arrivals per second")
    parser.add_argument("--words", type=int, default=30, help="interactive prompt words")
    parser.add_argument("--tokens", type=int, default=8, help="interactive tokens generated")
    parser.add_argument("--batch-clients", type=int, default=16)
    parser.add_argument("--batch-words", type=int, default=60)
    parser.add_argument("--batch-tokens", type=int, default=32)
    args = parser.parse_args()
    stats = lambda: requests.get(f"{args.url}/stats", timeout=30).json()  # noqa: E731
    before = stats()
    phases = (
        {"idle": (None, True), "batch_alone": (1000, False), "priorities_on": (1000, True), "priorities_off": (0, True)}
        if args.scenario == "mixed"
        else {"overload": (None, True)}
    )
    for name, (batch_priority, interactive) in phases.items():
        result = run_phase(args.url, args, batch_priority, interactive)
        print(json.dumps({"phase": name, **result}), flush=True)
    after = stats()
    print(
        json.dumps(
            {
                "kv_blocks_used_before": before["kv_blocks_used"],
                "kv_blocks_used_after": after["kv_blocks_used"],
                "kv_cache_integrity": after["kv_cache_integrity"],
                "requests_failed": after["requests_failed"] - before["requests_failed"],
                "requests_refused": after["requests_refused"],
                "preemptions": after["preemptions"] - before["preemptions"],
            }
        )
    )


if __name__ == "__main__":
    main()
