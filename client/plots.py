"""The benchmark's pictures, one PNG each: matplotlib, no display needed."""

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: servers and CI have no display
import matplotlib.pyplot as plt  # noqa: E402

Run = dict[str, Any]  # one run as the benchmark's JSON holds it


def _ok(run: Run) -> list[dict[str, Any]]:
    return [r for r in run["requests"] if r["ok"]]


def latency_vs_tokens(runs: list[Run], path: Path) -> None:
    """Why dynamic batching is fairer to short requests: latency against requested length, per mode."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        tokens, latency = zip(*((r["requested_tokens"], r["latency_s"]) for r in _ok(run))) if _ok(run) else ((), ())
        ax.scatter(tokens, latency, s=12, alpha=0.7, label=run["label"])
    ax.set(xlabel="requested tokens", ylabel="end-to-end latency (s)", title="Latency against requested length")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def throughput_and_ttft(runs: list[Run], path: Path) -> None:
    """Output tokens/s and p99 time to first token, one bar per run."""
    labels = [run["label"] for run in runs]
    throughput = [run["summary"]["output_tokens_per_s"] for run in runs]
    ttft_p99 = [(run["summary"]["ttft_ms"] or {}).get("p99", 0) / 1000 for run in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(labels, throughput, color="tab:blue")
    left.set(ylabel="output tokens/s", title="Throughput (higher is better)")
    right.bar(labels, ttft_p99, color="tab:orange")
    right.set(ylabel="seconds", title="p99 time to first token (lower is better)")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


def latency_cdf(runs: list[Run], path: Path) -> None:
    """The share of requests finished within each latency."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        latencies = sorted(r["latency_s"] for r in _ok(run))
        shares = [(i + 1) / len(latencies) for i in range(len(latencies))]
        ax.step(latencies, shares, where="post", label=run["label"])
    ax.set(xlabel="end-to-end latency (s)", ylabel="share of requests", title="Latency CDF", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def batch_size_sweep(runs: list[Run], path: Path) -> None:
    """Throughput and p99 TTFT against MAX_BATCH_SIZE, one line per mode (and prefix-cache setting)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    series = lambda run: run["label"].split(" b=")[0]  # the label without its batch size
    for name in dict.fromkeys(map(series, runs)):
        points = sorted(
            ((run["batch_size"], run["summary"]) for run in runs if series(run) == name), key=lambda p: p[0]
        )
        sizes = [size for size, _ in points]
        throughput = [s["output_tokens_per_s"] for _, s in points]
        ttft_p99 = [(s["ttft_ms"] or {}).get("p99", 0) / 1000 for _, s in points]
        if len(points) == 1:  # nobatch (or a baseline) runs once: a level to compare the lines with
            left.axhline(throughput[0], linestyle="--", color="grey", label=name)
            right.axhline(ttft_p99[0], linestyle="--", color="grey", label=name)
            continue
        left.plot(sizes, throughput, marker="o", label=name)
        right.plot(sizes, ttft_p99, marker="o", label=name)
    left.set(xlabel="MAX_BATCH_SIZE", ylabel="output tokens/s", title="Throughput")
    right.set(xlabel="MAX_BATCH_SIZE", ylabel="seconds", title="p99 time to first token", yscale="log")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, path)


def cluster_comparison(runs: list[Run], path: Path) -> None:
    """Cluster runs side by side: prefix-cache hit rate, output tokens/s, and TTFT median and p99."""
    runs = [run for run in runs if run.get("replicas")]
    labels = [run["label"] for run in runs]
    hits = [100 * (run["server_stats"] or {}).get("prefix_cache_hit_rate", 0) for run in runs]
    throughput = [run["summary"]["output_tokens_per_s"] for run in runs]
    ttft = [run["summary"]["ttft_ms"] or {} for run in runs]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4.5))
    left.bar(labels, hits, color="tab:green")
    left.set(ylabel="% of prompt tokens", title="Prefix-cache hits (higher is better)", ylim=(0, 100))
    middle.bar(labels, throughput, color="tab:blue")
    middle.set(ylabel="output tokens/s", title="Throughput (higher is better)")
    positions = range(len(runs))
    right.bar([x - 0.2 for x in positions], [t.get("p50", 0) / 1000 for t in ttft], 0.4, label="median")
    right.bar([x + 0.2 for x in positions], [t.get("p99", 0) / 1000 for t in ttft], 0.4, label="p99")
    right.set(ylabel="seconds", title="Time to first token (lower is better)", xticks=list(positions))
    right.set_xticklabels(labels)
    right.legend()
    for ax in (left, middle, right):
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
        ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(runs: list[Run], out_dir: Path) -> list[Path]:
    """Every picture that fits these runs, written into `out_dir`; their paths."""
    pictures = {
        "latency_vs_tokens.png": latency_vs_tokens,
        "throughput_ttft.png": throughput_and_ttft,
        "latency_cdf.png": latency_cdf,
    }
    if len({run["batch_size"] for run in runs if run["batch_size"]}) > 1:
        pictures["batch_size_sweep.png"] = batch_size_sweep
    if any(run.get("replicas") for run in runs):
        pictures["cluster.png"] = cluster_comparison
    for name, draw in pictures.items():
        draw(runs, out_dir / name)
    return [out_dir / name for name in pictures]
