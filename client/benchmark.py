"""The batching experiment: the same deterministic workload against each scheduling mode.

For each mode it starts ./server.sh itself (settings from the environment, e.g.
MODEL=random:gpt2), sends the workload, reads /stats, stops the server and moves on.

python client/benchmark.py --workload seed-like               # 100 requests, Poisson 1 req/s
python client/benchmark.py --workload saturate --numsamples 256
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client.client import fetch_stats, run_load  # noqa: E402
from client.data import PromptData, arrival_offsets  # noqa: E402
from client.launch import running_server  # noqa: E402
from client.metrics import summarize  # noqa: E402

MODES = ("nobatch", "static", "dynamic")
WORKLOADS = {  # name: (requests, arrivals per second)
    "seed-like": (100, 1.0),
    "saturate": (256, float("inf")),
}


def run_mode(mode: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    samples = PromptData(seed=args.seed, mean_tokens=args.mean_tokens).samples(args.numsamples)
    offsets = arrival_offsets(args.numsamples, args.rate, args.seed)
    with running_server(mode, log_dir) as url:
        results, duration_s = run_load(url, samples, offsets, temperature=args.temperature, timeout=args.timeout)
        stats = fetch_stats(url, args.timeout)
    return {"mode": mode, "summary": summarize(results, duration_s), "server": stats}


def comparison_table(runs: list[dict[str, Any]]) -> str:
    header = f"{'mode':<9}{'ok':>5}{'fail':>5}{'dur s':>8}{'out tok/s':>11}"
    header += f"{'lat p50':>9}{'lat p99':>9}{'ttft p50':>9}{'ttft p99':>9}{'tpot p50':>9}{'tpot p99':>9}"
    lines = [header + "   (latencies in ms)"]
    for run in runs:
        s = run["summary"]
        row = f"{run['mode']:<9}{s['requests_ok']:>5}{s['requests_failed']:>5}{s['duration_s']:>8.1f}"
        row += f"{s['output_tokens_per_s']:>11.1f}"
        for key in ("latency_ms", "ttft_ms", "tpot_ms"):
            row += "".join(f"{getattr(s[key], q):>9.0f}" if s[key] else f"{'-':>9}" for q in ("p50", "p99"))
        lines.append(row)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=WORKLOADS, default="seed-like")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " + ", ".join(MODES))
    parser.add_argument("--numsamples", type=int, help="requests (default: the workload's)")
    parser.add_argument("--rate", type=float, help="arrivals per second, inf for all at once (default: the workload's)")
    parser.add_argument("--mean-tokens", type=float, default=100.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--json", type=Path, help="write every run's summary and /stats here")
    args = parser.parse_args(argv)
    default_n, default_rate = WORKLOADS[args.workload]
    args.numsamples = args.numsamples or default_n
    args.rate = args.rate or default_rate
    args.modes = args.modes.split(",")
    if not set(args.modes) <= set(MODES):
        parser.error(f"--modes must be taken from {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as log_dir:
        runs = [run_mode(mode, args, Path(log_dir)) for mode in args.modes]
    print(f"\nworkload {args.workload}: {args.numsamples} requests at {args.rate} req/s, seed {args.seed}")
    print(comparison_table(runs))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2, default=lambda o: o._asdict()))
    return 1 if any(run["summary"]["requests_failed"] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
