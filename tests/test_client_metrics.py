import pytest

from client.metrics import (
    RequestResult,
    Summary,
    describe,
    format_table,
    percentile,
    summarize,
    tpot,
    ttft_by_prompt_length,
)


def ok_result(output_tokens: int, ttft_s: float | None, latency_s: float) -> RequestResult:
    return RequestResult(
        ok=True,
        prompt_tokens=5,
        output_tokens=output_tokens,
        ttft_s=ttft_s,
        latency_s=latency_s,
        error=None,
        requested_tokens=output_tokens,
    )


def failed_result(error: str, latency_s: float = 0.01) -> RequestResult:
    return RequestResult(
        ok=False, prompt_tokens=0, output_tokens=0, ttft_s=None, latency_s=latency_s, error=error, requested_tokens=8
    )


@pytest.mark.parametrize(
    ("values", "p", "expected"),
    [
        ([1, 2, 3, 4], 50, 2.5),
        ([4, 1, 3, 2], 50, 2.5),  # order of the input does not matter
        ([1, 2, 3, 4], 0, 1),
        ([1, 2, 3, 4], 100, 4),
        ([1, 2, 3, 4], 25, 1.75),  # rank 0.75 between 1 and 2
        ([10, 20], 99, 19.9),  # rank 0.99 between 10 and 20
        ([7], 99, 7),
    ],
)
def test_percentile_interpolates_between_ranks(values, p, expected):
    assert percentile(values, p) == pytest.approx(expected)


def test_percentile_rejects_empty_input_and_bad_p():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_describe():
    # mean 10/4; p99 at rank 2.97: 3 + 0.97 * (4 - 3)
    assert describe([1, 2, 3, 4]) == pytest.approx(Summary(mean=2.5, p50=2.5, p99=3.97))
    assert describe([]) is None


def test_tpot_excludes_the_first_token():
    # 11 tokens: the first arrives at TTFT, the other 10 share the remaining 2.0 - 0.5 s.
    assert tpot(ok_result(output_tokens=11, ttft_s=0.5, latency_s=2.0)) == pytest.approx(0.15)


@pytest.mark.parametrize(
    "result",
    [
        ok_result(output_tokens=1, ttft_s=0.5, latency_s=0.6),
        ok_result(output_tokens=0, ttft_s=None, latency_s=0.6),
        ok_result(output_tokens=10, ttft_s=None, latency_s=0.6),
        failed_result("HTTP 500"),
    ],
)
def test_tpot_is_undefined_without_two_tokens_and_a_ttft(result):
    assert tpot(result) is None


def test_summarize_counts_and_wall_clock_throughput():
    results = [
        ok_result(output_tokens=11, ttft_s=0.5, latency_s=2.0),  # tpot 0.15 s
        ok_result(output_tokens=21, ttft_s=1.0, latency_s=3.0),  # tpot 0.1 s
        failed_result("HTTP 500: boom"),
        failed_result("HTTP 500: boom"),
        failed_result("ConnectionError: refused"),
    ]
    summary = summarize(results, duration_s=4.0)
    assert summary["requests_ok"] == 2
    assert summary["requests_failed"] == 3
    assert summary["duration_s"] == 4.0
    assert summary["output_tokens"] == 32
    # 32 tokens over the 4 s of the run, not over the 5 s the latencies add up to.
    assert summary["output_tokens_per_s"] == pytest.approx(8.0)
    assert summary["requests_per_s"] == pytest.approx(0.5)
    # Latencies in ms of the successful requests only: 2000 and 3000; p99 at 2000 + 0.99 * 1000.
    assert summary["latency_ms"] == pytest.approx(Summary(mean=2500, p50=2500, p99=2990))
    assert summary["ttft_ms"] == pytest.approx(Summary(mean=750, p50=750, p99=995))
    assert summary["tpot_ms"] == pytest.approx(Summary(mean=125, p50=125, p99=149.5))
    assert summary["errors"] == {"HTTP 500: boom": 2, "ConnectionError: refused": 1}


def test_summarize_with_every_request_failed():
    summary = summarize([failed_result("timeout")], duration_s=1.0)
    assert summary["requests_ok"] == 0
    assert summary["output_tokens_per_s"] == 0
    assert summary["latency_ms"] is None
    assert summary["ttft_ms"] is None
    assert summary["tpot_ms"] is None


def test_summarize_rejects_a_non_positive_duration():
    with pytest.raises(ValueError):
        summarize([], duration_s=0.0)


def test_format_table_aligns_rows_and_lists_errors():
    results = [ok_result(output_tokens=12, ttft_s=0.5, latency_s=2.0), failed_result("HTTP 500: boom")]
    table = format_table(summarize(results, duration_s=4.0))
    lines = table.splitlines()
    assert lines[0].split() == ["requests", "ok", "1"]
    assert lines[1].split() == ["requests", "failed", "1"]
    assert next(line for line in lines if line.startswith("output tokens/s")).split()[-1] == "3.0"  # 12 / 4 s
    header = next(line for line in lines if line.split() == ["mean", "p50", "p99"])
    latency = next(line for line in lines if line.startswith("latency (ms)"))
    assert latency.split()[-3:] == ["2000.0", "2000.0", "2000.0"]
    assert len(latency) == len(header)  # the numbers sit under their column names
    assert "1 x HTTP 500: boom" in table


def test_format_table_marks_missing_timings():
    table = format_table(summarize([failed_result("timeout")], duration_s=1.0))
    ttft = next(line for line in table.splitlines() if line.startswith("ttft (ms)"))
    assert ttft.split()[-3:] == ["-", "-", "-"]


def streamed(ttft_s: float, arrivals_s: list[float], prompt_tokens: int = 5) -> RequestResult:
    """A streamed request on a hand-made timeline: first text at ttft_s, then a chunk at each arrival."""
    times = [ttft_s, *arrivals_s]
    return RequestResult(
        ok=True,
        prompt_tokens=prompt_tokens,
        output_tokens=len(times),
        ttft_s=ttft_s,
        latency_s=times[-1],
        error=None,
        requested_tokens=len(times),
        itl_s=tuple(b - a for a, b in zip(times, times[1:])),
    )


def test_streamed_timeline_gives_ttft_tpot_and_pooled_itl():
    a = streamed(0.2, [0.3, 0.5, 0.6])  # gaps 0.1, 0.2, 0.1; tpot (0.6 - 0.2) / 3
    b = streamed(1.0, [1.4], prompt_tokens=15)  # gap 0.4; tpot 0.4
    summary = summarize([a, b], duration_s=2.0)
    assert summary["ttft_ms"] == pytest.approx(Summary(mean=600, p50=600, p99=992))
    mid, p99 = (400 / 3 + 400) / 2, 400 / 3 + 0.99 * (400 - 400 / 3)
    assert summary["tpot_ms"] == pytest.approx(Summary(mean=mid, p50=mid, p99=p99))
    # Gaps pooled over both requests: 100, 100, 200, 400 ms; p99 at rank 2.97 between 200 and 400.
    assert summary["itl_ms"] == pytest.approx(Summary(mean=200, p50=150, p99=394))
    assert summary["latency_ms"] == pytest.approx(Summary(mean=1000, p50=1000, p99=1392))
    # 600 ms over 4 tokens and 1400 ms over 2.
    assert summary["latency_per_token_ms"] == pytest.approx(Summary(mean=425, p50=425, p99=150 + 0.99 * 550))
    # 20 prompt + 6 output tokens over 2 s.
    assert (summary["input_tokens"], summary["output_tokens"]) == (20, 6)
    assert summary["total_tokens_per_s"] == pytest.approx(13.0)
    assert summary["output_tokens_per_s"] == pytest.approx(3.0)
    assert "goodput_requests_per_s" not in summary


def test_goodput_counts_requests_within_every_slo():
    fast = streamed(0.1, [0.15, 0.2])  # ttft 100 ms, tpot 50 ms, e2el 200 ms
    slow_start = streamed(0.9, [0.95, 1.0])  # ttft 900 ms
    slow_tokens = streamed(0.1, [0.4, 0.7])  # tpot 300 ms
    one_token = streamed(0.1, [])  # tpot undefined: only its TTFT and latency can miss
    failed = failed_result("HTTP 500")
    results = [fast, slow_start, slow_tokens, one_token, failed]
    summary = summarize(results, duration_s=2.0, slos_ms={"ttft": 500, "tpot": 100})
    assert summary["goodput_requests_per_s"] == pytest.approx(2 / 2.0)  # fast and one_token
    assert summarize(results, 2.0, {"e2el": 800})["goodput_requests_per_s"] == pytest.approx(3 / 2.0)
    assert summarize(results, 2.0, {"ttft": 50})["goodput_requests_per_s"] == 0


def test_ttft_by_prompt_length_splits_at_512_tokens():
    short = [ok_result(4, 0.1, 1.0), ok_result(4, 0.3, 1.0)]
    long = ok_result(4, 2.0, 3.0)._replace(prompt_tokens=512)
    groups = ttft_by_prompt_length([*short, long, failed_result("HTTP 500")])
    assert groups["prompt < 512"] == pytest.approx(Summary(mean=200, p50=200, p99=298))
    assert groups["prompt >= 512"] == pytest.approx(Summary(mean=2000, p50=2000, p99=2000))
    assert ttft_by_prompt_length(short)["prompt >= 512"] is None
