"""The peers comparison's report: the machine, one row per load shape and system, and the greedy agreement."""

import os
from pathlib import Path
from statistics import mean, stdev
from typing import Any

from benchmarks import llama_server, vllm_server
from client.bench_results import machine as torch_machine
from client.report import render, results_tables

CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
REFERENCE = "ours"  # the system every other's outputs and throughput are compared with


def machine(binary: Path | None, vllm_python: Path | None = None) -> dict[str, Any]:
    """What the figures were measured on: CPU, its flags that matter to bfloat16 and int8 kernels, memory, load."""
    flags: set[str] = set()
    memory_gib = None
    if Path("/proc/cpuinfo").exists():
        line = next((x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")), "")
        flags = set(line.partition(":")[2].split())
        total_kb = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal"))
        memory_gib = round(int(total_kb.split()[1]) / 2**20, 1)
    return {
        **torch_machine(),
        "cpu_flags": [flag for flag in CPU_FLAGS if flag in flags],
        "memory_gib": memory_gib,
        "llama_cpp": llama_server.version(binary) if binary else None,
        "vllm": vllm_server.version(vllm_python) if vllm_python else None,
        "load_before": os.getloadavg(),
    }


def same_outputs(a: dict[str, Any], b: dict[str, Any]) -> int:
    """How many requests got the same greedy text in runs `a` and `b`. The servers render a byte that is not UTF-8
    differently (and llama-server drops a character cut off by the length limit), so replacement characters are
    left out of both sides: equal tokens still give equal texts, and unequal tokens almost never do."""
    clean = lambda r: None if r["text"] is None else r["text"].replace("\ufffd", "")
    return sum(x["ok"] and y["ok"] and clean(x) == clean(y) for x, y in zip(a["requests"], b["requests"], strict=True))


def summary_rows(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """One row per load shape and system, averaged over its rounds; equal outputs against this server's first run
    of the shape (for this server: its later rounds against its first). Others' cores are what else kept the
    machine busy meanwhile: on a shared machine, the column that says which figures compare."""
    header = [
        "shape",
        "system",
        "rounds",
        "out tok/s",
        f"vs {REFERENCE}",
        "round by round",
        "TTFT p50 ms",
        "TTFT p99 ms",
    ]
    header += ["ITL p50 ms", "ITL p99 ms", "peak PSS MiB", "peak RSS MiB", "server cores", "others' cores", "ok"]
    header.append(f"outputs = {REFERENCE}")
    rows = []
    for shape in dict.fromkeys(run["shape"] for run in runs):
        of_shape = [run for run in runs if run["shape"] == shape]
        reference = [run for run in of_shape if run["system"] == REFERENCE]
        base_tps = mean(r["summary"]["output_tokens_per_s"] for r in reference) if reference else None
        by_round = {r.get("repeat"): r["summary"]["output_tokens_per_s"] for r in reference}
        for system in dict.fromkeys(run["system"] for run in of_shape):
            group = [run for run in of_shape if run["system"] == system]
            rows.append([shape, system, *_cells(group, base_tps, reference[0] if reference else None, by_round)])
    return header, rows


def _by_round(group: list[dict[str, Any]], reference_tps: dict[Any, float]) -> str:
    """The system's throughput against this server's in the same round (the runs alternate, so each pair shares
    its hour): the least and the most of these ratios and their spread, which say more than the ratio of the
    means on a machine that drifts."""
    if group[0]["system"] == REFERENCE:
        return "-"
    ratios = [
        r["summary"]["output_tokens_per_s"] / reference_tps[r["repeat"]]
        for r in group
        if r.get("repeat") is not None and reference_tps.get(r["repeat"])
    ]
    if len(ratios) < 2:
        return f"{ratios[0]:.2f}x" if ratios else "-"
    return f"{min(ratios):.2f}-{max(ratios):.2f}x (sd {stdev(ratios):.3f})"


def _cells(
    group: list[dict[str, Any]], base_tps: float | None, reference: dict[str, Any] | None, by_round: dict[Any, float]
) -> list[str]:
    measured = lambda key: [r["summary"][key] for r in group if r["summary"][key]]
    average = lambda key, q: mean(stats[q] for stats in measured(key)) if measured(key) else None
    fmt = lambda value, spec=".1f": "-" if value is None else format(value, spec)
    tps = mean(r["summary"]["output_tokens_per_s"] for r in group)
    peak = lambda kind: max((r["memory"][kind] or 0 for r in group if r.get("memory")), default=None)
    # cores busy on average (client.cpu): the server's, and the machine's less the server's and the client's
    cores = lambda key: mean(r["cpu"][key] for r in group if r.get("cpu")) if any(r.get("cpu") for r in group) else None
    compared = [r for r in group if r is not reference] if reference else []
    equal = f"{sum(same_outputs(reference, r) for r in compared)}/{sum(len(r['requests']) for r in compared)}"
    return [
        str(len(group)),
        fmt(tps),
        f"{tps / base_tps:.2f}x" if base_tps else "-",
        _by_round(group, by_round),
        fmt(average("ttft_ms", "p50")),
        fmt(average("ttft_ms", "p99")),
        fmt(average("itl_ms", "p50")),
        fmt(average("itl_ms", "p99")),
        fmt(peak("pss_mib"), ".0f"),
        fmt(peak("rss_mib"), ".0f"),
        fmt(cores("server"), ".2f"),
        fmt(cores("other"), ".2f"),
        f"{sum(r['summary']['requests_ok'] for r in group)}/{sum(len(r['requests']) for r in group)}",
        equal if compared else "-",
    ]


def summary_table(runs: list[dict[str, Any]], markdown: bool) -> str:
    header, rows = summary_rows(runs)
    return render(header, rows, labels=2, markdown=markdown)


def write_report(path: Path, results: dict[str, Any]) -> None:
    """A Markdown page: the command, the machine, the summary, then every run's tables."""
    m = results["machine"]
    load = lambda key: " / ".join(f"{x:.2f}" for x in m[key]) if m.get(key) else "-"
    lines = [
        f"# {results['title']}",
        "",
        f"- command: `{results['command']}`",
        f"- machine: {m['cpus']} x {m['cpu']} ({', '.join(m['cpu_flags']) or 'no AVX-512'}), {m['memory_gib']} GiB;"
        f" torch {m['torch']}, Python {m['python']}",
        f"- llama.cpp: {m['llama_cpp']}; vLLM: {m.get('vllm')}",
        f"- load average (1/5/15 min) before: {load('load_before')}, after: {load('load_after')}",
        "",
        summary_table(results["runs"], markdown=True),
        "",
        "## Every run",
        "",
        results_tables(results["runs"], markdown=True),
        "",
        *(f"- {run['label']}: `{run['command']}` {run.get('env', '')}" for run in results["runs"]),
    ]
    path.write_text("\n".join(lines) + "\n")
