"""The batching experiment: one deterministic workload against each scheduling mode, and a baseline.

For each run it starts ./server.sh itself (settings from the environment, e.g. MODEL=random:gpt2-medium),
sends the workload's first request once, untimed, then streams the workload through /v1/completions, reads
/stats, stops the server and moves on; or, with
--url, measures the server already running there. Prints a table and writes into --out the raw
per-request measurements (results.json), the plots and, with --report, a Markdown report.

python client/benchmark.py --workload seed-like --baseline --report
python client/benchmark.py --workload saturate --numsamples 64 --temperature 0 --modes dynamic \
    --baseline transformers,transformers-cb                  # both transformers baselines, greedy outputs compared
python client/benchmark.py --workload saturate --numsamples 128 --max-concurrency 64
python client/benchmark.py --workload shared-prefix            # prefix cache off vs on
python client/benchmark.py --workload saturate --batch-sizes 8,32,128 --modes static,dynamic
python client/benchmark.py --workload long-prompts           # chunked prefill off vs on
python client/benchmark.py --workload grouped-prefix --replicas 1,4 --balance prefix,roundrobin   # ./cluster.sh
"""

import argparse
import importlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import requests  # noqa: E402

from client.bench_args import parse_args  # noqa: E402
from client.bench_results import keep_logs, machine, merged, publish, resummarize, write_results  # noqa: E402
from client.bench_runs import RunSpec, measure, measure_baseline, planned_runs, started  # noqa: E402
from client.launch import stop_all_on_signal  # noqa: E402
from client.workloads import build  # noqa: E402
from config import setting_fields  # noqa: E402

__all__ = ["main", "parse_args", "planned_runs"]
SETTING_NAMES = [name.upper() for name in setting_fields()]
TRANSFORMERS_INSTALL = "pip install 'transformers>=5.0'"  # what the baselines need (requirements-dev.txt has it)


def check_dependencies(args: argparse.Namespace) -> str | None:
    """What the run will need that is not installed, as a one-line error naming the install command; None if
    nothing. Checked before the first server starts, so no measurement is lost to a missing package."""
    needs = {"matplotlib": ("the plots", "pip install -r requirements.txt")}
    if args.baseline:
        needs["transformers"] = ("--baseline", TRANSFORMERS_INSTALL)
    for module, (what, install) in needs.items():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return f"{what} needs {module}, which cannot be imported ({exc}): {install}"
    if "transformers-cb" in args.baseline:
        from transformers import GenerationMixin

        if not hasattr(GenerationMixin, "init_continuous_batching"):
            return f"--baseline transformers-cb needs transformers' continuous batching (5.x): {TRANSFORMERS_INSTALL}"
    return None


def run_experiment(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Every planned run, then the baselines; the whole record that results.json holds, written into --out as each
    run ends (a run cut short loses only itself: `--rebuild` makes the tables and plots of what was measured)."""
    workload = build(args.workload, args.numsamples, args.rate, args.mean_tokens, args.seed, args.groups)
    # The server settings this process passes on, so the command in the report can be run again as it was.
    settings = [f"{name}={os.environ[name]}" for name in SETTING_NAMES if os.environ.get(name)]
    results = {
        "title": f"workload {args.workload}: {args.numsamples} requests at {args.rate} req/s, seed {args.seed}"
        + (f", {args.groups} groups" if args.workload == "grouped-prefix" else ""),
        "command": " ".join([*settings, "python client/benchmark.py", *argv]),
        "machine": machine(),
        "args": vars(args),
        "runs": [],
    }

    def done(run: dict[str, Any]) -> None:
        results["runs"].append(run)
        s = run["summary"]
        print(f"{run['label']}: {s['requests_ok']}/{s['requests_ok'] + s['requests_failed']} ok, "
              f"{s['output_tokens_per_s']:.1f} output tok/s", flush=True)  # fmt: skip
        write_results(results, args.out)

    if args.url:
        mode = requests.get(f"{args.url}/health", timeout=10).json()["mode"]
        done(measure(args.url.rstrip("/"), RunSpec(mode, mode, {}, None), workload, args))
    else:
        with tempfile.TemporaryDirectory() as log_dir:
            for spec in planned_runs(args):
                with started(spec, Path(log_dir)) as (url, pid):
                    run = measure(url, spec, workload, args, server_pid=pid)
                keep_logs(Path(log_dir), args.out / "logs")  # KV blocks, kernel compiles, graph capture, errors
                done(run)
    for name in args.baseline:  # after the servers stopped, so each has the device to itself
        done(measure_baseline(name, workload, args))
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv, __doc__)
    if args.rebuild:
        results = resummarize(merged(args.rebuild))
    else:
        missing = check_dependencies(args)
        if missing:
            print(f"benchmark: {missing}", file=sys.stderr)
            return 2
        restore_signals = stop_all_on_signal()  # a stopped benchmark leaves no server behind
        try:
            results = run_experiment(args, argv)
        finally:
            restore_signals()
    publish(results, args.rebuild[0] if args.rebuild and len(args.rebuild) == 1 else args.out, args.report)
    return 1 if any(run["summary"]["requests_failed"] for run in results["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
