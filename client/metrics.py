"""Per-request results and the summary of a benchmark run. Pure functions, no I/O."""

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple


class RequestResult(NamedTuple):
    ok: bool
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None  # first streamed text, or as reported by the server
    latency_s: float  # wall time measured by the client
    error: str | None
    requested_tokens: int
    itl_s: tuple[float, ...] = ()  # gaps between streamed chunks; empty without streaming
    sent_s: float = 0.0  # when it was sent, from the start of the run
    replica: str | None = None  # the replica that answered (its X-Replica header), behind a balancer
    text: str | None = None  # the completion's text, to compare greedy outputs between runs


def failure(error: str, latency_s: float, requested_tokens: int) -> RequestResult:
    """The record of a request that got no usable answer."""
    return RequestResult(False, 0, 0, None, latency_s, error, requested_tokens)


def streamed(
    start_s: float,
    end_s: float,
    arrivals: list[float],
    prompt_tokens: int,
    output_tokens: int,
    requested_tokens: int,
    **rest: Any,
) -> RequestResult:
    """The record of a streamed answer, from when it was sent, when it ended and when each text event
    arrived (one clock); `rest` fills the optional fields (text, replica)."""
    return RequestResult(
        ok=True,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        ttft_s=arrivals[0] - start_s if arrivals else None,
        latency_s=end_s - start_s,
        error=None,
        requested_tokens=requested_tokens,
        itl_s=tuple(b - a for a, b in zip(arrivals, arrivals[1:])),
        **rest,
    )


# Service-level objectives a request must meet to count towards goodput, in ms.
SLO_METRICS = ("ttft", "tpot", "e2el")


class Summary(NamedTuple):
    mean: float
    p50: float
    p99: float


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0 <= p <= 100), interpolating linearly between ranks as numpy does by default."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"p must be in [0, 100], got {p}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    lower = math.floor(rank)
    upper = math.ceil(rank)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (rank - lower)


def describe(values: Sequence[float]) -> Summary | None:
    """Mean, median and p99 of `values`, or None when there are none."""
    if not values:
        return None
    return Summary(mean=sum(values) / len(values), p50=percentile(values, 50), p99=percentile(values, 99))


def tpot(result: RequestResult) -> float | None:
    """Time per output token after the first, in seconds, as vLLM's benchmark_serving defines it.

    None when it is undefined: a failed request, no TTFT, or fewer than two output tokens.
    """
    if not result.ok or result.ttft_s is None or result.output_tokens <= 1:
        return None
    return (result.latency_s - result.ttft_s) / (result.output_tokens - 1)


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request is within every SLO; TPOT counts as met when it is undefined (one token)."""
    if not result.ok:
        return False
    measured_s = {"ttft": result.ttft_s, "tpot": tpot(result), "e2el": result.latency_s}
    for metric, limit_ms in slos_ms.items():
        value = measured_s[metric]
        if value is None and metric == "tpot":
            continue
        if value is None or value * 1000 > limit_ms:
            return False
    return True


def summarize(
    results: Sequence[RequestResult], duration_s: float, slos_ms: dict[str, float] | None = None
) -> dict[str, Any]:
    """Counts, throughput over the wall-clock `duration_s` of the run, and latency statistics in ms.

    Timing statistics cover successful requests only: a failed request's latency says nothing about generation.
    Inter-token latencies are pooled over every request, as vLLM's benchmark does. With `slos_ms` (keys from
    SLO_METRICS), goodput is the rate of requests that met all of them.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [t for t in map(tpot, ok) if t is not None]
    errors = Counter(r.error or "unknown error" for r in results if not r.ok)
    summary = {
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "duration_s": duration_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration_s,
        "total_tokens_per_s": (input_tokens + output_tokens) / duration_s,
        "requests_per_s": len(ok) / duration_s,
        "latency_ms": describe([r.latency_s * 1000 for r in ok]),
        # The original demo's "latency per token": what a request waited, queueing included, per token it got.
        "latency_per_token_ms": describe([r.latency_s * 1000 / r.output_tokens for r in ok if r.output_tokens]),
        "ttft_ms": describe([r.ttft_s * 1000 for r in ok if r.ttft_s is not None]),
        "tpot_ms": describe([t * 1000 for t in tpots]),
        "itl_ms": describe([gap * 1000 for r in ok for gap in r.itl_s]),
        "errors": dict(errors.most_common()),
    }
    if slos_ms:
        assert set(slos_ms) <= set(SLO_METRICS), slos_ms
        summary["goodput_requests_per_s"] = sum(meets_slos(r, slos_ms) for r in ok) / duration_s
    return summary


LONG_PROMPT = 512  # tokens: where the report splits TTFT by prompt length


def ttft_by_prompt_length(results: Sequence[RequestResult]) -> dict[str, Summary | None]:
    """TTFT (ms) of successful requests with prompts shorter than LONG_PROMPT and of the others."""
    ok = [r for r in results if r.ok and r.ttft_s is not None]
    return {
        f"prompt < {LONG_PROMPT}": describe([r.ttft_s * 1000 for r in ok if r.prompt_tokens < LONG_PROMPT]),
        f"prompt >= {LONG_PROMPT}": describe([r.ttft_s * 1000 for r in ok if r.prompt_tokens >= LONG_PROMPT]),
    }


_COUNT_ROWS = (
    ("requests ok", "requests_ok", "{:d}"),
    ("requests failed", "requests_failed", "{:d}"),
    ("duration (s)", "duration_s", "{:.2f}"),
    ("output tokens", "output_tokens", "{:d}"),
    ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
    ("ok requests/s", "requests_per_s", "{:.2f}"),
)

_TIMING_ROWS = (
    ("latency (ms)", "latency_ms"),
    ("ttft (ms)", "ttft_ms"),
    ("tpot (ms)", "tpot_ms"),
    ("itl (ms)", "itl_ms"),
)


def format_table(summary: dict[str, Any]) -> str:
    """`summarize`'s result as aligned plain text, followed by each distinct error and its count."""
    label_width = max(len(label) for label, *_ in _COUNT_ROWS + _TIMING_ROWS)
    lines = [f"{label:<{label_width}}  {fmt.format(summary[key]):>10}" for label, key, fmt in _COUNT_ROWS]
    lines.append("")
    lines.append(f"{'':<{label_width}}  " + "  ".join(f"{name:>10}" for name in Summary._fields))
    for label, key in _TIMING_ROWS:
        stats = summary[key]
        cells = ["-"] * len(Summary._fields) if stats is None else [f"{value:.1f}" for value in stats]
        lines.append(f"{label:<{label_width}}  " + "  ".join(f"{cell:>10}" for cell in cells))
    if summary["errors"]:
        lines.append("")
        lines.append("errors:")
        lines.extend(f"  {count} x {message}" for message, count in summary["errors"].items())
    return "\n".join(lines)
