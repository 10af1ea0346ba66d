"""/metrics through a real server: vLLM's series (what its example Grafana dashboard queries)
are there, labelled model_name, and count exactly the traffic this test sends."""

import json
import re

import requests
from conftest import ROOT
from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = (
    "vllm:e2e_request_latency_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_max_num_generation_tokens",
)
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
GAUGES += ("vllm:gpu_cache_usage_perc",)
COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def complete(url: str, model: str, prompt: str, max_tokens: int, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    answer = requests.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_vllm_series_count_the_traffic_sent(url, model):
    label = (("model_name", model),)
    prompts = ["The lighthouse keeper", "Ships in the night", "A lamp", "Grey water " * 6]
    sent = [(p, n, {"ignore_eos": True}) for p, n in zip(prompts, [5, 1, 12, 30])]
    # A stop string taken from the greedy continuation itself: that request surely ends on "stop".
    text = complete(url, model, "Gulls over the harbour", 20, ignore_eos=True)["choices"][0]["text"]
    stop = text[len(text) // 2 :][:4]
    sent.append(("Gulls over the harbour", 20, {"stop": [stop], "ignore_eos": True}))
    before = scrape(url)  # after the probe: only `sent` is counted below
    answers = [complete(url, model, p, n, **extra) for p, n, extra in sent]

    after = scrape(url)
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    reasons = [a["choices"][0]["finish_reason"] for a in answers]
    assert reasons == ["length"] * 4 + ["stop"]
    assert delta[("vllm:prompt_tokens_total", label)] == prompt_tokens
    assert delta[("vllm:generation_tokens_total", label)] == generated
    for reason in ("length", "stop", "abort"):
        key = ("vllm:request_success_total", tuple(sorted((*label, ("finished_reason", reason)))))
        assert delta[key] == reasons.count(reason), reason
    # one observation per request of each per-request histogram
    for name in HISTOGRAMS:
        assert delta[(f"{name}_count", label)] == len(sent), name
    assert delta[("vllm:request_prompt_tokens_sum", label)] == prompt_tokens
    assert delta[("vllm:request_generation_tokens_sum", label)] == generated
    assert delta[("vllm:request_max_num_generation_tokens_sum", label)] == sum(n for _, n, _ in sent)
    # a request's time per output token needs two tokens; one inter-token latency per token after the first
    longer = sum(a["usage"]["completion_tokens"] > 1 for a in answers)
    assert delta[("vllm:request_time_per_output_token_seconds_count", label)] == longer == len(sent) - 1
    for name in ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"):
        assert delta[(f"{name}_count", label)] == generated - len(sent), name
    assert delta[("vllm:time_to_first_token_seconds_bucket", (("le", "+Inf"), *label))] == len(sent)
    # nothing left running; every series carries the served model's name
    for name in GAUGES:
        assert after[(name, label)] == 0, name
    vllm_names = {name for name, labels in after if name.startswith("vllm:")}
    assert {f"{h}_bucket" for h in HISTOGRAMS} | set(COUNTERS) | set(GAUGES) <= vllm_names
    assert all(dict(labels).get("model_name") == model for name, labels in after if name.startswith("vllm:"))
    # the project's own names read the same table
    assert after[("gpt2_generated_tokens_total", ())] == after[("vllm:generation_tokens_total", label)]
    assert after[("gpt2_ttft_seconds_count", ())] == after[("vllm:time_to_first_token_seconds_count", label)]
    assert delta[("gpt2_requests_total", (("outcome", "ok"),))] == len(sent)


def test_the_grafana_dashboard_queries_only_series_the_server_exports(url):
    dashboard = json.loads((ROOT / "deploy" / "grafana-gpt2.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queried = {name for expr in exprs for name in re.findall(r"\bgpt2_[a-z0-9_]+", expr)}
    exported = {name for name, _ in scrape(url)}
    assert len(queried) > 10 and queried <= exported, queried - exported
    assert all(panel["datasource"]["uid"] == "${DS_PROMETHEUS}" for panel in dashboard["panels"])
