"""The benchmark end to end against real servers on a tiny checkpoint, and its workloads."""

import asyncio
import json
import statistics
from collections import Counter

import pytest
from matplotlib.image import imread

from client.benchmark import main, parse_args, planned_runs
from client.launch import running_server
from client.report import cluster_table
from client.stream import stream_completion
from client.workloads import CONTEXT, GROUPS, SYSTEM_PROMPT_TOKENS, WORKLOADS, Request, build, group_system_prompts
from model.tokenizer import load_tokenizer


@pytest.fixture
def tiny_server_env(tiny_checkpoint, monkeypatch):
    """Servers the benchmark starts, and its baseline, read their settings from the environment."""
    monkeypatch.setenv("MODEL", str(tiny_checkpoint))
    monkeypatch.setenv("KV_CACHE_BLOCKS", "1024")


@pytest.mark.parametrize("name", WORKLOADS)
def test_workloads_are_deterministic_and_fit_the_context(name):
    a, b = build(name, 40, 2.0, 30, seed=3), build(name, 40, 2.0, 30, seed=3)
    assert a == b
    assert build(name, 40, 2.0, 30, seed=4).requests != a.requests
    assert all(len(r.prompt_ids) + r.num_tokens <= CONTEXT and r.num_tokens >= 1 for r in a.requests)
    assert len({r.seed for r in a.requests}) == 40  # every request its own sampling seed
    assert a.offsets[0] == 0 and a.offsets == sorted(a.offsets)


def test_shared_prefix_prompts_share_one_system_prompt():
    requests = build("shared-prefix", 20, float("inf"), 16).requests
    system = requests[0].prompt_ids[:SYSTEM_PROMPT_TOKENS]
    assert all(r.prompt_ids[:SYSTEM_PROMPT_TOKENS] == system for r in requests)
    assert len({tuple(r.prompt_ids[SYSTEM_PROMPT_TOKENS:]) for r in requests}) > 10  # the questions differ


def test_grouped_prefix_requests_share_their_groups_system_prompt():
    tokenizer = load_tokenizer()
    systems = group_system_prompts(tokenizer, GROUPS)
    assert len({tuple(s[:16]) for s in systems}) == GROUPS  # what the balancer hashes differs between groups
    assert all(len(s) == SYSTEM_PROMPT_TOKENS for s in systems)
    requests = build("grouped-prefix", 400, 10.0, 16).requests
    groups = Counter(next(g for g, s in enumerate(systems) if r.prompt_ids[: len(s)] == s) for r in requests)
    assert set(groups) == set(range(GROUPS)) and min(groups.values()) > 25  # every group, drawn evenly
    assert len({tuple(r.prompt_ids[SYSTEM_PROMPT_TOKENS:]) for r in requests}) > 100  # the questions differ
    assert all(len(r.prompt_ids) < SYSTEM_PROMPT_TOKENS + 80 for r in requests)  # short questions
    assert {len(group_system_prompts(tokenizer, 3))} == {3}


def test_sharegpt_like_lengths_have_chat_means_and_a_long_tail():
    requests = build("sharegpt-like", 2000, 1.0, 338).requests
    prompts, outputs = [len(r.prompt_ids) for r in requests], [r.num_tokens for r in requests]
    # Log-normal with sigma 1: mean 161 (a little less after clipping), median ~ 161 * exp(-1/2) ~ 98.
    assert 130 < statistics.mean(prompts) < 170 and 85 < statistics.median(prompts) < 115
    assert max(prompts) > 3 * statistics.median(prompts)
    assert 280 < statistics.mean(outputs) < 350


def test_long_prompts_arrive_steadily_while_32_decoders_run():
    workload = build("long-prompts", 40, 0.25, 200)
    decoders, long = workload.requests[:32], workload.requests[32:]
    assert workload.offsets[:32] == [0.0] * 32
    assert workload.offsets[32:] == [2.0 + 4.0 * i for i in range(8)]
    assert all(len(r.prompt_ids) < 100 for r in decoders) and statistics.mean(r.num_tokens for r in decoders) > 150
    assert all(700 <= len(r.prompt_ids) <= 1000 and r.num_tokens == 16 for r in long)
    with pytest.raises(ValueError, match="more than 32 requests"):
        build("long-prompts", 32, 0.25, 200)


def test_long_prompts_runs_compare_chunked_prefill_off_and_on():
    runs = planned_runs(parse_args(["--workload", "long-prompts"]))
    assert [(r.label, r.settings) for r in runs] == [
        ("dynamic chunked-off", {"PREFIX_CACHE": "on", "CHUNKED_PREFILL": "off", "MAX_BATCH_TOKENS": "0"}),
        ("dynamic chunked-on", {"PREFIX_CACHE": "on"}),
    ]


def test_runs_cover_every_mode_cache_setting_and_batch_size():
    args = parse_args(["--workload", "shared-prefix"])
    assert [(r.label, r.mode, r.settings) for r in planned_runs(args)] == [
        ("dynamic cache-off", "dynamic", {"PREFIX_CACHE": "off"}),
        ("dynamic cache-on", "dynamic", {"PREFIX_CACHE": "on"}),
    ]
    sweep = planned_runs(parse_args(["--batch-sizes", "4,16"]))
    assert [r.label for r in sweep] == ["nobatch", "static b=4", "static b=16", "dynamic b=4", "dynamic b=16"]
    assert sweep[0].settings == {"PREFIX_CACHE": "on"} and sweep[0].batch_size is None
    assert sweep[2].settings == {"PREFIX_CACHE": "on", "MAX_BATCH_SIZE": "16"}


def test_cluster_runs_are_one_per_replica_count_and_balance():
    args = parse_args(["--workload", "grouped-prefix", "--replicas", "1,2,4", "--balance", "prefix,roundrobin"])
    assert [(r.label, r.replicas, r.balance, r.settings) for r in planned_runs(args)] == [
        ("dynamic 1 replica", 1, "prefix", {"PREFIX_CACHE": "on"}),  # nothing to balance: once
        ("dynamic 2 replicas prefix", 2, "prefix", {"PREFIX_CACHE": "on"}),
        ("dynamic 2 replicas roundrobin", 2, "roundrobin", {"PREFIX_CACHE": "on"}),
        ("dynamic 4 replicas prefix", 4, "prefix", {"PREFIX_CACHE": "on"}),
        ("dynamic 4 replicas roundrobin", 4, "roundrobin", {"PREFIX_CACHE": "on"}),
    ]
    scaling = planned_runs(parse_args(["--workload", "saturate", "--modes", "dynamic", "--replicas", "1,2"]))
    assert [(r.label, r.balance) for r in scaling] == [
        ("dynamic 1 replica", "prefix"),
        ("dynamic 2 replicas", "prefix"),
    ]
    assert [r.replicas for r in planned_runs(parse_args(["--modes", "static"]))] == [None]  # one server, no cluster


def test_the_cluster_table_compares_each_run_with_one_replica():
    def run(label: str, replicas: int, tok_s: float, served: list[str], settings: dict) -> dict:
        requests = [{"ok": True, "replica": name} for name in served]
        summary = {"output_tokens_per_s": tok_s, "ttft_ms": {"mean": 1.0, "p50": 2.0, "p99": 3.0}}
        stats = {"prefix_cache_hit_rate": 0.5}
        return {"label": label, "mode": "dynamic", "settings": settings, "batch_size": None, "replicas": replicas,
                "summary": summary, "server_stats": stats, "requests": requests}  # fmt: skip

    runs = [
        run("one", 1, 100.0, ["a"] * 4, {"PREFIX_CACHE": "on"}),
        run("two", 2, 190.0, ["a", "b", "b", "b"], {"PREFIX_CACHE": "on"}),
        run("two, cache off", 2, 150.0, ["a", "b"], {"PREFIX_CACHE": "off"}),  # no one-replica run of its own
    ]
    header, rows = cluster_table(runs)
    assert [row[header.index("vs 1 replica")] for row in rows] == ["1.00x", "1.90x", "-"]
    assert [row[header.index("requests per replica")] for row in rows] == ["4", "3/1", "1/1"]
    assert rows[0][header.index("prefix-cache hits")] == "50.0%"


@pytest.mark.parametrize(
    "argv",
    [
        ["--modes", "eager"],
        ["--prefix-cache", "maybe"],
        ["--slo", "ttft"],
        ["--slo", "x:1"],
        ["--replicas", "0"],
        ["--balance", "leastconn"],
        ["--url", "http://127.0.0.1:1", "--replicas", "2"],
        ["--groups", "0"],
    ],
)
def test_bad_arguments_are_usage_errors(argv):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2


def test_a_short_benchmark_writes_results_plots_and_report(tiny_server_env, tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["--workload", "saturate", "--numsamples", "6", "--mean-tokens", "6", "--modes", "nobatch,dynamic"]
    argv += ["--baseline", "--baseline-batch", "4", "--slo", "ttft:60000", "--out", str(out), "--report"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert [run["label"] for run in results["runs"]] == ["nobatch", "dynamic", "transformers b=4"]
    workload = build("saturate", 6, float("inf"), 6)
    for run in results["runs"]:
        assert run["summary"]["requests_ok"] == 6 and run["summary"]["goodput_requests_per_s"] > 0
        for request, sent in zip(run["requests"], workload.requests):
            # The server was asked to ignore end-of-text: exactly the requested tokens come back.
            assert request["output_tokens"] == request["requested_tokens"] == sent.num_tokens
            assert request["prompt_tokens"] == len(sent.prompt_ids)
            assert 0 < request["ttft_s"] <= request["latency_s"]
            assert len(request["itl_s"]) <= sent.num_tokens - 1
        assert run["label"] in printed
    # the workload's first request sent once before each server's run, untimed (vLLM's initial test prompt)
    assert results["runs"][0]["server_stats"]["requests_completed"] == 7
    assert all(run["initial_test"]["ok"] for run in results["runs"][:2]) and "initial_test" not in results["runs"][2]
    # where each server's step time went: one row per server run, none for the baseline
    step_table = printed[printed.index("with prefill") :]
    assert "deliver ms" in step_table and "nobatch" in step_table and "transformers" not in step_table
    assert "| with prefill |" in (out / "report.md").read_text()
    for name in ("latency_vs_tokens.png", "throughput_ttft.png", "latency_cdf.png"):
        height, width, _ = imread(out / name).shape  # parses as an image
        assert height > 100 and width > 100
        assert f"]({name})" in (out / "report.md").read_text()
    settings, _, arguments = results["command"].partition("python client/benchmark.py")
    assert f"MODEL={tiny_checkpoint}" in settings.split() and "KV_CACHE_BLOCKS=1024" in settings.split()
    assert arguments.split() == argv


def test_benchmark_measures_a_running_server_at_url(tiny_checkpoint, tmp_path):
    with running_server("static", tmp_path, MODEL=str(tiny_checkpoint), KV_CACHE_BLOCKS="1024") as url:
        argv = ["--url", url, "--workload", "seed-like", "--numsamples", "4", "--rate", "50", "--mean-tokens", "4"]
        assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    (run,) = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    assert run["label"] == "static" and run["summary"]["requests_ok"] == 4


def test_stream_records_a_refused_request_as_failed(tiny_checkpoint, tmp_path):
    with running_server("dynamic", tmp_path, MODEL=str(tiny_checkpoint), KV_CACHE_BLOCKS="1024") as url:
        good = asyncio.run(
            stream_completion(url, Request([464, 46371, 28356], 12, seed=1), temperature=1.0, timeout=60)
        )
        too_long = asyncio.run(stream_completion(url, Request([464] * 1000, 100, seed=1), temperature=1.0, timeout=60))
    assert good.ok and good.output_tokens == 12 and good.prompt_tokens == 3
    assert not too_long.ok and too_long.error.startswith("HTTP 400") and "context" in too_long.error


def test_a_request_not_streamed_has_its_counts_and_text_and_no_ttft(tiny_checkpoint, tmp_path):
    request, too_long = Request([464, 46371, 28356], 12, seed=1), Request([464] * 1000, 100, seed=1)
    with running_server("dynamic", tmp_path, MODEL=str(tiny_checkpoint), KV_CACHE_BLOCKS="1024") as url:
        streamed = asyncio.run(stream_completion(url, request, temperature=0.0, timeout=60))
        whole = asyncio.run(stream_completion(url, request, temperature=0.0, timeout=60, stream=False))
        refused = asyncio.run(stream_completion(url, too_long, temperature=0.0, timeout=60, stream=False))
    assert whole.ok and (whole.prompt_tokens, whole.output_tokens) == (3, 12)
    assert whole.ttft_s is None and whole.itl_s == () and whole.text == streamed.text  # greedy: the same text
    assert not refused.ok and refused.error.startswith("HTTP 400") and "context" in refused.error


def test_rebuild_recomputes_summaries_from_the_raw_requests(tmp_path):
    results = {
        "title": "hand-made",
        "command": "python client/benchmark.py",
        "machine": {"cpu": "x", "cpus": 1, "gpu": None, "torch": "t", "python": "p"},
        "args": {"slo": {"ttft": 150}},
        "runs": [
            {
                "label": "dynamic",
                "mode": "dynamic",
                "batch_size": None,
                "model": "m",
                "summary": {"duration_s": 2.0},  # all the rest is recomputed
                "requests": [
                    {"ok": True, "prompt_tokens": 4, "output_tokens": 3, "ttft_s": 0.1, "latency_s": 0.5,
                     "error": None, "requested_tokens": 3, "itl_s": [0.2, 0.2], "sent_s": 0.0},
                    {"ok": True, "prompt_tokens": 6, "output_tokens": 2, "ttft_s": 0.2, "latency_s": 0.3,
                     "error": None, "requested_tokens": 2, "itl_s": [0.1], "sent_s": 0.5},
                ],
            }
        ],
    }  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert main(["--rebuild", str(tmp_path), "--report"]) == 0
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert run["summary"]["total_tokens_per_s"] == pytest.approx((10 + 5) / 2.0)
    assert run["summary"]["goodput_requests_per_s"] == pytest.approx(1 / 2.0)  # only the first met TTFT 150 ms
    assert run["summary"]["itl_ms"]["mean"] == pytest.approx(500 / 3)
    assert "| dynamic | TTFT | 150.0 | 150.0 |" in (tmp_path / "report.md").read_text()


def test_shared_prefix_runs_show_the_cache_at_work(tiny_server_env, tmp_path):
    argv = ["--workload", "shared-prefix", "--numsamples", "8", "--mean-tokens", "4", "--out", str(tmp_path)]
    argv += ["--batch-sizes", "2,8"]
    assert main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    runs = {run["label"]: run for run in results["runs"]}
    assert list(runs) == [
        "dynamic cache-off b=2",
        "dynamic cache-off b=8",
        "dynamic cache-on b=2",
        "dynamic cache-on b=8",
    ]
    assert {run["server_stats"]["prefix_cache_hit_rate"] for run in runs.values() if "off" in run["label"]} == {0.0}
    # Only prompts admitted in the first step miss: at most 3 of ~535 tokens fit its 2048-token budget, so 5 of
    # 8 or more find the system prompt's 31 full blocks (496 tokens) cached: a hit rate of 5 * 496 / 8 / 567 > 0.5.
    assert all(runs[f"dynamic cache-on b={b}"]["server_stats"]["prefix_cache_hit_rate"] > 0.5 for b in (2, 8))
    assert runs["dynamic cache-on b=8"]["server_stats"]["kv_blocks_total"] == 1024
    assert (tmp_path / "batch_size_sweep.png").exists() and imread(tmp_path / "batch_size_sweep.png").shape[0] > 100


def test_both_transformers_baselines_run_the_same_requests_and_agree_with_the_server_greedily(
    tiny_server_env, tmp_path, capsys
):
    out = tmp_path / "bench"
    argv = ["--workload", "saturate", "--numsamples", "8", "--mean-tokens", "8", "--temperature", "0"]
    argv += ["--modes", "dynamic", "--baseline", "transformers,transformers-cb", "--out", str(out), "--report"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    assert [run["label"] for run in runs] == ["dynamic", "transformers b=256", "transformers-cb"]
    workload = build("saturate", 8, float("inf"), 8)
    for run in runs:
        assert run["summary"]["requests_ok"] == 8
        for request, sent in zip(run["requests"], workload.requests):
            assert request["output_tokens"] == request["requested_tokens"] == sent.num_tokens
            assert request["prompt_tokens"] == len(sent.prompt_ids) and request["text"]
            assert 0 < request["ttft_s"] <= request["latency_s"]
    # greedy: every output of each baseline is the server's, and the tables say so
    texts = [[request["text"] for request in run["requests"]] for run in runs]
    assert texts[1] == texts[0] and texts[2] == texts[0]
    assert "outputs equal to dynamic" in printed and printed.count(" 8/8 ") >= 2
    settings = runs[2]["baseline_settings"]
    assert settings["max_batch_tokens"] == 512 and settings["block_size"] > 0 and "sdpa" in settings["attention"]
    assert "transformers-cb" in (out / "report.md").read_text()


def test_modes_none_runs_only_what_baseline_names():
    assert planned_runs(parse_args(["--modes", "none", "--baseline", "transformers-cb"])) == []
    with pytest.raises(SystemExit):
        parse_args(["--modes", "none"])
    with pytest.raises(SystemExit):
        parse_args(["--baseline", "vllm"])


def test_rebuild_of_several_directories_puts_their_runs_in_one_table(tmp_path):
    request = {"ok": True, "prompt_tokens": 4, "output_tokens": 3, "ttft_s": 0.1, "latency_s": 0.5, "error": None,
               "requested_tokens": 3, "itl_s": [0.2, 0.2], "sent_s": 0.0}  # fmt: skip
    machine = {"cpu": "x", "cpus": 1, "gpu": None, "torch": "t", "python": "p"}
    for name, seconds in (("after", 1.0), ("before", 3.0)):
        run = {"label": "dynamic", "mode": "dynamic", "batch_size": None, "model": "m",
               "summary": {"duration_s": seconds}, "requests": [request]}  # fmt: skip
        results = {"title": name, "command": "c", "machine": machine, "args": {"slo": {}}, "runs": [run]}
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(results))
    out = tmp_path / "both"
    assert main(["--rebuild", str(tmp_path / "after"), str(tmp_path / "before"), "--out", str(out)]) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["label"], r["summary"]["output_tokens_per_s"]) for r in runs] == [
        ("dynamic", pytest.approx(3.0)),
        ("dynamic (before)", pytest.approx(1.0)),
    ]
