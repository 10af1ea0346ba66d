"""The batching experiment's runs: what each is (RunSpec), the servers it starts, what it measures,
and the offline baselines. Each run's record is what results.json holds (client/bench_results.py)."""

import argparse
import contextlib
import functools
import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from client import cpu
from client.client import fetch_stats, run_load
from client.launch import start_cluster, start_server, stop_server
from client.metrics import RequestResult, Summary, summarize
from client.stream import stream_completion
from client.workloads import Workload
from config import EngineSettings
from model.loader import resolve_model


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
    then counted apart); the run's record, as results.json holds it.

    First, untimed, the workload's first request alone, as vLLM's `bench serve` sends its initial test prompt: what
    a fresh server does on first use (on a GPU, loading the kernels a prefill and the sampler take: an H200 server's
    first request took 188 ms, the next ones 14-25) stays out of the run. The server's counters include it. Not to a
    cluster, where it would reach one replica and count in its /stats alone (its runs compare their routing)."""
    send = functools.partial(stream_completion, url, temperature=args.temperature, timeout=args.timeout)
    initial = None
    if not spec.replicas:
        (initial,), _ = run_load(send, workload.requests[:1], [0.0])
        if not initial.ok:
            print(f"{spec.label}: the initial test request failed ({initial.error}); the run goes on", flush=True)
    before = cpu.sample(server_pid)
    results, duration_s = run_load(send, workload.requests, workload.offsets, args.max_concurrency)
    used = cpu.usage(before, cpu.sample(server_pid))
    stats = fetch_stats(url, args.timeout)  # a cluster's names the model when every replica serves the same
    run = record(spec, stats.get("model"), results, duration_s, args, server_stats=stats, cpu=used)
    if initial:
        run["initial_test"] = {"ok": initial.ok, "ttft_s": initial.ttft_s, "error": initial.error}
    return run


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


def _as_json(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v._asdict() if isinstance(v, Summary) else v for k, v in summary.items()}
