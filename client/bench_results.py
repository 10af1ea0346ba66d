"""The batching experiment's results: results.json written as runs end, read back and merged for
--rebuild, the machine they were measured on, and the tables, plots and report made from them."""

import json
import os
import platform
import shutil
from pathlib import Path
from typing import Any

from client.bench_runs import _as_json
from client.metrics import RequestResult, summarize
from client.report import results_tables, write_report


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
