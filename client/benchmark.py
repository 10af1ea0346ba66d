"""The batching experiment: one deterministic workload against each scheduling mode, and a baseline.

For each run it starts ./server.sh itself (settings from the environment, e.g. MODEL=random:gpt2-medium),
streams the workload through /v1/completions, reads /stats, stops the server and moves on; or, with
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
import contextlib
import functools
import importlib
import itertools
import json
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

if not __package__:  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import requests  # noqa: E402

from client import cpu  # noqa: E402
from client.client import fetch_stats, run_load  # noqa: E402
from client.launch import start_cluster, start_server, stop_all_on_signal, stop_server  # noqa: E402
from client.metrics import SLO_METRICS, RequestResult, Summary, summarize  # noqa: E402
from client.report import results_tables, write_report  # noqa: E402
from client.stream import stream_completion  # noqa: E402
from client.workloads import GROUPS, WORKLOADS, Workload, build  # noqa: E402
from config import MODES, EngineSettings, setting_fields  # noqa: E402
from model.loader import resolve_model  # noqa: E402

SETTING_NAMES = [name.upper() for name in setting_fields()]
BALANCES = ("prefix", "roundrobin")  # cluster.sh's BALANCE
# transformers' static `generate` in padded batches, and its continuous batching over a paged cache
BASELINES = ("transformers", "transformers-cb")
TRANSFORMERS_INSTALL = "pip install 'transformers>=5.0'"  # what the baselines need (requirements-dev.txt has it)


class RunSpec(NamedTuple):
    label: str
    mode: str  # a server mode, or a baseline's name (BASELINES)
    settings: dict[str, str]  # server settings on top of the environment
    batch_size: int | None  # MAX_BATCH_SIZE when the run sets it
    replicas: int | None = None  # a cluster of this many replicas behind HAProxy (./cluster.sh), or one server
    balance: str | None = None  # the cluster's BALANCE


def planned_runs(args: argparse.Namespace) -> list[RunSpec]:
    """Every mode x prefix-cache setting x chunked-prefill setting x batch size x cluster asked for, labelled by
    what varies.

    nobatch runs one request at a time whatever MAX_BATCH_SIZE says, so a sweep runs it once. Unchunked
    runs take MAX_BATCH_TOKENS' default, which then covers a whole context. A cluster of one replica has
    nothing to balance, so it runs once whatever --balance says.
    """
    runs = []
    for mode, cache, chunked in itertools.product(args.modes, args.prefix_cache, args.chunked_prefill):
        for size in ([] if mode == "nobatch" else args.batch_sizes) or [None]:
            label = mode + (f" cache-{cache}" if len(args.prefix_cache) > 1 else "")
            label += f" chunked-{chunked}" if len(args.chunked_prefill) > 1 else ""
            label += f" b={size}" if size and len(args.batch_sizes) > 1 else ""
            settings = {"PREFIX_CACHE": cache}
            if chunked == "off":  # and MAX_BATCH_TOKENS' default, which then covers a whole context
                settings |= {"CHUNKED_PREFILL": "off", "MAX_BATCH_TOKENS": "0"}
            settings |= {"MAX_BATCH_SIZE": str(size)} if size else {}
            for replicas in args.replicas or [None]:
                for balance in [None] if replicas is None else args.balance[: 1 if replicas == 1 else None]:
                    cluster = ""
                    if replicas:
                        cluster = f" {replicas} replica" + ("s" if replicas > 1 else "")
                        cluster += f" {balance}" if replicas > 1 and len(args.balance) > 1 else ""
                    runs.append(RunSpec(label + cluster, mode, settings, size, replicas, balance))
    return runs


@contextlib.contextmanager
def started(spec: RunSpec, log_dir: Path) -> Iterator[tuple[str, int]]:
    """./server.sh, or ./cluster.sh for a cluster, started for `spec` and healthy: its URL and process id."""
    if spec.replicas:
        run_dir = tempfile.mkdtemp(prefix="cluster-", dir=log_dir)  # its HAProxy configuration, logs and sockets
        settings = {"BALANCE": spec.balance, "RUN_DIR": run_dir, **spec.settings}
        proc, url = start_cluster([str(spec.replicas), spec.mode], log_dir, **settings)
    else:
        proc, url = start_server(spec.mode, log_dir, **spec.settings)
    print(f"{spec.label}: server up at {url} (process group {proc.pid})", flush=True)
    try:
        yield url, proc.pid
    finally:
        stop_server(proc)


def measure(
    url: str, spec: RunSpec, workload: Workload, args: argparse.Namespace, server_pid: int | None = None
) -> dict[str, Any]:
    """Send the workload to a healthy server at `url` (started here as `server_pid`, whose processes' CPU use is
    then counted apart); the run's record, as results.json holds it."""
    send = functools.partial(stream_completion, url, temperature=args.temperature, timeout=args.timeout)
    before = cpu.sample(server_pid)
    results, duration_s = run_load(send, workload.requests, workload.offsets, args.max_concurrency)
    used = cpu.usage(before, cpu.sample(server_pid))
    stats = fetch_stats(url, args.timeout)  # a cluster's names the model when every replica serves the same
    return record(spec, stats.get("model"), results, duration_s, args, server_stats=stats, cpu=used)


def record(
    spec: RunSpec,
    model: str | None,
    results: list[RequestResult],
    duration_s: float,
    args: argparse.Namespace,
    server_stats: dict[str, Any] | None = None,
    cpu: dict[str, float] | None = None,
) -> dict[str, Any]:
    return {
        **spec._asdict(),
        "model": model,
        "summary": _as_json(summarize(results, duration_s, args.slo)),
        "server_stats": server_stats,
        "cpu": cpu,  # average cores busy during the run (client.cpu.usage)
        "requests": [r._asdict() for r in results],
    }


def measure_baseline(name: str, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """One baseline (BASELINES) on the workload, offline, on the device the servers used."""
    from model.tokenizer import load_tokenizer

    settings = EngineSettings.from_env()
    used = None
    # transformers is imported only when a baseline is asked for: the server does not need it
    if name == "transformers-cb":
        from client.baseline_cb import run_cb_baseline

        results, duration_s, tokens, used = run_cb_baseline(workload, settings, args.temperature)
        spec = RunSpec(name, name, {}, None)
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in used.items()), flush=True)
    else:
        from client.baseline import run_baseline

        size = args.baseline_batch or settings.max_batch_size
        results, duration_s, tokens = run_baseline(workload, settings, size, args.temperature)
        spec = RunSpec(f"transformers b={size}", name, {}, size)
    tokenizer = load_tokenizer()
    results = [r._replace(text=tokenizer.decode(ids)) for r, ids in zip(results, tokens, strict=True)]
    return {**record(spec, resolve_model(settings.model).name, results, duration_s, args), "baseline_settings": used}


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


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return {
        "cpu": names[0] if names else platform.processor(),
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def parse_slo(text: str) -> tuple[str, float]:
    metric, _, ms = text.partition(":")
    if metric not in SLO_METRICS:
        raise argparse.ArgumentTypeError(f"SLO metric must be one of {', '.join(SLO_METRICS)}, got {metric!r}")
    try:
        return metric, float(ms)
    except ValueError:
        raise argparse.ArgumentTypeError(f"SLO must look like ttft:500 (milliseconds), got {text!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def merged(directories: list[Path]) -> dict[str, Any]:
    """The results.json of each directory, their runs together; a label met before gets its directory's name."""
    parts = [(d, json.loads((d / "results.json").read_text())) for d in directories]
    runs, seen = [], set()
    for directory, part in parts:
        for run in part["runs"]:
            label = run["label"] if run["label"] not in seen else f"{run['label']} ({directory.name})"
            seen.add(label)
            runs.append({**run, "label": label})
    return {**parts[0][1], "runs": runs}


def resummarize(results: dict[str, Any]) -> dict[str, Any]:
    """`results` with every run's summary computed again from its raw requests (after the metrics changed)."""
    for run in results["runs"]:
        measured = [RequestResult(**r) for r in run["requests"]]
        run["summary"] = _as_json(summarize(measured, run["summary"]["duration_s"], results["args"]["slo"]))
    return results


def _as_json(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v._asdict() if isinstance(v, Summary) else v for k, v in summary.items()}


def _to_microseconds(value: Any) -> Any:
    """`value` with every float rounded to 6 decimals: timings finer than a microsecond are noise, and
    full-precision floats would make a run of thousands of streamed requests tens of megabytes."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {key: _to_microseconds(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_to_microseconds(item) for item in value]
    return value


def keep_logs(log_dir: Path, into: Path) -> None:
    """Copy the servers' logs (not a cluster's sockets) out of the run's temporary directory."""
    for log in log_dir.rglob("*.log"):
        target = into / log.relative_to(log_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, target)


def write_results(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_to_microseconds(results), separators=(",", ":"), default=str))


def publish(results: dict[str, Any], out: Path, report: bool) -> None:
    """Print the tables; write results.json, the plots and, if asked, report.md into `out`."""
    tables = results_tables(results["runs"], markdown=False, greedy=results["args"].get("temperature") == 0)
    print(f"\n{results['title']}\n{tables}")
    write_results(results, out)
    from client.plots import plot_all  # matplotlib: checked before the first server starts (check_dependencies)

    pictures = plot_all(results["runs"], out)
    if report:
        write_report(out / "report.md", results, pictures)
    print(f"results, plots{' and report' if report else ''} in {out}/")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
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
