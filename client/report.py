"""The benchmark's tables, as aligned text or Markdown, and its Markdown report."""

from collections import Counter
from pathlib import Path
from typing import Any

from client.metrics import RequestResult, ttft_by_prompt_length

LATENCIES = (
    ("TTFT", "ttft_ms"),
    ("TPOT", "tpot_ms"),
    ("ITL", "itl_ms"),
    ("E2EL", "latency_ms"),
    ("E2EL/token", "latency_per_token_ms"),
)


def results_tables(runs: list[dict[str, Any]], markdown: bool, greedy: bool = False) -> str:
    """Throughput per run, then latency per run and metric (mean / median / p99, ms), as serving benchmarks report;
    for `greedy` runs, how many outputs each run shares with the first."""
    goodput = "goodput_requests_per_s" in runs[0]["summary"] if runs else False
    header = ["run", "ok", "failed", "duration s", "req/s", "out tok/s", "total tok/s"] + ["goodput req/s"] * goodput
    rows = []
    for run in runs:
        s = run["summary"]
        row = [run["label"], str(s["requests_ok"]), str(s["requests_failed"]), f"{s['duration_s']:.1f}"]
        row += [f"{s['requests_per_s']:.2f}", f"{s['output_tokens_per_s']:.1f}", f"{s['total_tokens_per_s']:.1f}"]
        rows.append(row + ([f"{s['goodput_requests_per_s']:.2f}"] if goodput else []))
    latency_rows = []
    for run in runs:
        for name, key in LATENCIES:
            stats = run["summary"][key]
            cells = [f"{stats[q]:.1f}" for q in ("mean", "p50", "p99")] if stats else ["-"] * 3
            latency_rows.append([run["label"], name, *cells])
    latency_header = ["run", "metric", "mean ms", "median ms", "p99 ms"]
    render = _markdown if markdown else _text
    tables = [render(header, rows, labels=1), render(latency_header, latency_rows, labels=2)]
    if any(run.get("replicas") for run in runs):
        tables.append(render(*cluster_table(runs), labels=1))
    if any(run.get("cpu") for run in runs):
        tables.append(render(*cpu_table(runs), labels=1))
    by_length = [(run["label"], ttft_by_prompt_length([RequestResult(**r) for r in run["requests"]])) for run in runs]
    if any(all(groups.values()) for _, groups in by_length):  # short and long prompts both ran: TTFT of each
        length_rows = [
            [label, f"TTFT, {group}", f"{stats.mean:.1f}", f"{stats.p50:.1f}", f"{stats.p99:.1f}"]
            for label, groups in by_length
            for group, stats in groups.items()
            if stats
        ]
        tables.append(render(latency_header, length_rows, labels=2))
    steps = _step_rows(runs)
    if steps:
        tables.append(render(STEP_HEADER, steps, labels=1))
    if any(run.get("baseline_settings") for run in runs):
        rows = [[r["label"], ", ".join(f"{k} {v}" for k, v in r["baseline_settings"].items())]
                for r in runs if r.get("baseline_settings")]  # fmt: skip
        tables.append(render(["baseline", "settings"], rows, labels=2))
    if greedy and len(runs) > 1:
        tables.append(render(*greedy_table(runs), labels=1))
    return "\n\n".join(tables)


def greedy_table(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Per run, the requests whose greedy output is the first run's, text for text (the server streams text;
    a baseline's tokens are decoded by the same tokenizer), and the first that differs."""
    first = runs[0]
    header = ["run", f"outputs equal to {first['label']}", "first that differs"]
    rows = []
    for run in runs[1:]:
        pairs = list(zip(first["requests"], run["requests"], strict=True))
        same = [a.get("text") is not None and a.get("text") == b.get("text") for a, b in pairs]
        differs = next((str(i) for i, equal in enumerate(same) if not equal), "-")
        rows.append([run["label"], f"{sum(same)}/{len(same)}", differs])
    return header, rows


STAGES = ("schedule", "build", "forward", "sample", "deliver")
STEP_HEADER = ["run", "steps", "with prefill", "step p50 ms", "step p99 ms", *(f"{s} ms" for s in STAGES)]


def _step_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    """Where a server's step time went (its /stats over the steps it kept): the next bottleneck, per run."""
    rows = []
    for run in runs:
        recent = (run.get("server_stats") or {}).get("recent_steps")
        if not recent or not recent["steps"]:
            continue
        ms = lambda seconds: "-" if seconds is None else f"{1000 * seconds:.2f}"
        step, stages = recent["step_time_s"], recent["stage_time_s"]
        row = [run["label"], str(recent["steps"]), str(recent["steps_with_prefill"]), ms(step["p50"]), ms(step["p99"])]
        rows.append(row + [ms(stages.get(stage)) for stage in STAGES])
    return rows


def cluster_table(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Each cluster run: its prefix-cache hit rate (the replicas' together), the requests each replica served,
    throughput against the one-replica run of the same settings, and TTFT."""
    header = ["run", "prefix-cache hits", "requests per replica", "out tok/s", "vs 1 replica", "TTFT p50 ms"]
    header.append("TTFT p99 ms")
    rows = []
    for run in runs:
        if not run.get("replicas"):
            continue
        s, stats = run["summary"], run["server_stats"] or {}
        single = next((r for r in runs if r.get("replicas") == 1 and _same_server(r, run)), None)
        served = Counter(r["replica"] for r in run["requests"] if r["ok"])
        ttft = s["ttft_ms"] or {}
        rows.append(
            [
                run["label"],
                f"{stats['prefix_cache_hit_rate']:.1%}" if "prefix_cache_hit_rate" in stats else "-",
                "/".join(str(n) for _, n in served.most_common()) or "-",
                f"{s['output_tokens_per_s']:.1f}",
                f"{s['output_tokens_per_s'] / single['summary']['output_tokens_per_s']:.2f}x" if single else "-",
                f"{ttft.get('p50', 0):.1f}",
                f"{ttft.get('p99', 0):.1f}",
            ]
        )
    return header, rows


def _same_server(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["mode"], a["settings"], a["batch_size"]) == (b["mode"], b["settings"], b["batch_size"])


def cpu_table(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Cores busy on average during each run (client.cpu): the machine's, and whose."""
    header = ["run", "machine cores busy", "server", "HAProxy", "client", "other"]
    keys = ("machine", "server", "haproxy", "client", "other")
    rows = [[run["label"], *(f"{run['cpu'][key]:.2f}" for key in keys)] for run in runs if run.get("cpu")]
    return header, rows


def render(header: list[str], rows: list[list[str]], labels: int, markdown: bool) -> str:
    """A table as Markdown or as aligned text, its first `labels` columns names and the rest numbers."""
    return (_markdown if markdown else _text)(header, rows, labels)


def _text(header: list[str], rows: list[list[str]], labels: int) -> str:
    """Aligned columns: the first `labels` to the left, numbers to the right."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  ".join(
        c.ljust(w) if i < labels else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    return "\n".join(line(r) for r in [header, *rows])


def _markdown(header: list[str], rows: list[list[str]], labels: int) -> str:
    rule = "|" + "|".join(["---"] * labels + ["---:"] * (len(header) - labels)) + "|"
    return "\n".join(["| " + " | ".join(header) + " |", rule] + ["| " + " | ".join(r) + " |" for r in rows])


def write_report(path: Path, results: dict[str, Any], pictures: list[Path]) -> None:
    """A Markdown page with what ran, where, the tables and the plots (linked relative to `path`)."""
    m = results["machine"]
    hardware = f"{m['cpus']} x {m['cpu']}" + (f", {m['gpu']}" if m["gpu"] else ", no GPU")
    models = sorted({str(run["model"]) for run in results["runs"]})
    lines = [
        f"# Benchmark: {results['title']}",
        "",
        f"- command: `{results['command']}`",
        f"- machine: {hardware}; torch {m['torch']}, Python {m['python']}",
        f"- model: {', '.join(models)}",
        "",
        results_tables(results["runs"], markdown=True, greedy=results["args"].get("temperature") == 0),
        "",
        *(f"![{picture.stem}]({picture.relative_to(path.parent)})\n" for picture in pictures),
    ]
    path.write_text("\n".join(lines))
