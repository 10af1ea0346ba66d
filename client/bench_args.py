"""The batching experiment's command line; client/benchmark.py runs it, and its docstring is the --help text."""

import argparse
from pathlib import Path

from client.metrics import SLO_METRICS
from client.workloads import GROUPS, WORKLOADS
from config import MODES

BALANCES = ("prefix", "roundrobin")  # cluster.sh's BALANCE
# transformers' static `generate` in padded batches, and its continuous batching over a paged cache
BASELINES = ("transformers", "transformers-cb")


def parse_slo(text: str) -> tuple[str, float]:
    metric, _, ms = text.partition(":")
    if metric not in SLO_METRICS:
        raise argparse.ArgumentTypeError(f"SLO metric must be one of {', '.join(SLO_METRICS)}, got {metric!r}")
    try:
        return metric, float(ms)
    except ValueError:
        raise argparse.ArgumentTypeError(f"SLO must look like ttft:500 (milliseconds), got {text!r}") from None


def parse_args(argv: list[str] | None, usage: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=usage, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=WORKLOADS, default="seed-like")
    parser.add_argument(
        "--modes", help="comma-separated, from " + ", ".join(MODES) + "; none: baselines only (default: the workload's)"
    )
    parser.add_argument("--prefix-cache", help="PREFIX_CACHE settings to run each mode with, e.g. off,on")
    parser.add_argument("--chunked-prefill", help="CHUNKED_PREFILL settings to run each mode with, e.g. off,on")
    parser.add_argument("--batch-sizes", help="MAX_BATCH_SIZE values to run each mode with, e.g. 8,32,128")
    parser.add_argument("--url", help="measure the server running here instead of starting one per run")
    parser.add_argument("--replicas", help="start ./cluster.sh with each of these numbers of replicas, e.g. 1,2,4")
    parser.add_argument("--balance", help="the clusters' BALANCE: " + ", ".join(BALANCES) + " (default: prefix)")
    parser.add_argument("--numsamples", type=int, help="requests (default: the workload's)")
    parser.add_argument("--rate", type=float, help="arrivals per second, inf for all at once (default: the workload's)")
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight at once (default: no limit)")
    parser.add_argument("--mean-tokens", type=float, help="mean requested tokens (default: the workload's)")
    parser.add_argument("--groups", type=int, default=GROUPS, help=f"grouped-prefix's system prompts ({GROUPS})")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    parser.add_argument("--slo", type=parse_slo, nargs="+", default=[], help="goodput SLOs in ms, e.g. ttft:500")
    parser.add_argument(
        "--baseline",
        nargs="?",
        const="transformers",
        default="",
        help="also run these, offline, comma-separated: transformers (static generate, the default), transformers-cb"
        " (its continuous batching)",
    )
    parser.add_argument("--baseline-batch", type=int, help="its static batch size (default: MAX_BATCH_SIZE)")
    parser.add_argument("--out", type=Path, help="where results.json and the plots go (default: results/WORKLOAD)")
    parser.add_argument("--report", action="store_true", help="also write report.md there, with table and plots")
    parser.add_argument(
        "--rebuild",
        type=Path,
        nargs="+",
        help="only recompute the tables and plots of the results.json here (of several: their runs together, in --out)",
    )
    args = parser.parse_args(argv)
    spec = WORKLOADS[args.workload]
    args.numsamples = args.numsamples or spec.numsamples
    args.rate = args.rate or spec.rate
    args.mean_tokens = args.mean_tokens or spec.mean_tokens
    args.modes = [] if args.modes == "none" else args.modes.split(",") if args.modes else list(spec.modes)
    args.prefix_cache = args.prefix_cache.split(",") if args.prefix_cache else list(spec.prefix_cache)
    args.chunked_prefill = args.chunked_prefill.split(",") if args.chunked_prefill else list(spec.chunked_prefill)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else []
    args.replicas = [int(n) for n in args.replicas.split(",")] if args.replicas else []
    args.balance = args.balance.split(",") if args.balance else [BALANCES[0]]
    args.slo = dict(args.slo)
    args.baseline = args.baseline.split(",") if args.baseline else []
    args.out = args.out or Path("results") / args.workload
    if not set(args.modes) <= set(MODES):
        parser.error(f"--modes must be taken from {', '.join(MODES)}")
    if not set(args.prefix_cache) <= {"on", "off"} or not set(args.chunked_prefill) <= {"on", "off"}:
        parser.error("--prefix-cache and --chunked-prefill take on, off or both")
    if args.numsamples < 1 or not args.rate > 0 or not args.mean_tokens >= 1 or min(args.batch_sizes, default=1) < 1:
        parser.error("--numsamples, --rate, --mean-tokens and --batch-sizes must be positive")
    if not set(args.baseline) <= set(BASELINES):
        parser.error(f"--baseline takes {', '.join(BASELINES)}")
    if not args.modes and not args.baseline and not args.url and not args.rebuild:
        parser.error("--modes none runs no server: give --baseline")
    if args.groups < 1:
        parser.error("--groups must be positive")
    if min(args.replicas, default=1) < 1 or not set(args.balance) <= set(BALANCES):
        parser.error(f"--replicas must be positive, --balance taken from {', '.join(BALANCES)}")
    if args.url and args.replicas:
        parser.error("--url measures a running server or cluster; --replicas starts clusters: give one")
    return args
