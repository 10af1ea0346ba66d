"""End to end: ./server.sh (gunicorn) with ENGINE=sim answers the same API, and its timings follow the profile."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
from conftest import sim_settings

from client.launch import running_server

STEP_S = 0.02  # every step of the simulated GPU (conftest.sim_settings)


@pytest.fixture(scope="module")
def sim_url(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sim")
    settings = {**sim_settings(directory, STEP_S), "MAX_BODY_BYTES": "65536"}
    with running_server("dynamic", directory, **settings) as url:
        yield url


def inference(url: str, prompt: str, n: int) -> dict:
    response = requests.post(f"{url}/inference", json={"prompt": prompt, "num_tokens": n}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_health_models_and_stats_name_the_simulation(sim_url):
    health = requests.get(f"{sim_url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["model"] == "sim:gpt2@fixed-step"
    models = requests.get(f"{sim_url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["sim:gpt2@fixed-step"]
    stats = requests.get(f"{sim_url}/stats", timeout=10).json()
    assert stats["model"] == "sim:gpt2@fixed-step" and stats["kv_blocks_total"] > 100_000  # 72 GiB of gpt2 KV


def test_inference_takes_the_profiles_time_per_token(sim_url):
    result = inference(sim_url, "The lighthouse keeper", 10)
    assert result["completion_tokens"] == len(result["token_ids"]) == 10
    assert result["completion"] == "The lighthouse keeper" + result["text"]
    # Ten steps that each sleep STEP_S: never less, and not much more on an idle server.
    assert 10 * STEP_S <= result["latency_s"] < 3 * 10 * STEP_S + 0.5
    assert STEP_S <= result["ttft_s"] < result["latency_s"]


def test_four_times_the_tokens_takes_about_four_times_as_long(sim_url):
    short = inference(sim_url, "Ships pass", 6)["latency_s"]
    long = inference(sim_url, "Ships pass", 24)["latency_s"]
    assert long > 2 * short


def test_concurrent_requests_share_steps(sim_url):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: inference(sim_url, f"Request {i}", 10), range(8)))
    assert all(len(r["token_ids"]) == 10 for r in results)
    # One after another they would take 8 x 10 steps; batched, about 10 to 20.
    assert max(r["latency_s"] for r in results) < 0.5 * 8 * 10 * STEP_S


def test_completions_streamed_and_not_agree(sim_url):
    body = {"prompt": "Gulls cried over grey water", "max_tokens": 12}
    whole = requests.post(f"{sim_url}/v1/completions", json=body, timeout=60).json()
    assert whole["model"] == "sim:gpt2@fixed-step"
    assert whole["choices"][0]["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 12
    with requests.post(f"{sim_url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=60) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_the_openai_client_works_against_the_simulation(sim_url):
    client = openai.OpenAI(base_url=f"{sim_url}/v1", api_key="unused")
    start = time.monotonic()
    completion = client.completions.create(model="sim:gpt2@fixed-step", prompt="Once upon a time", max_tokens=8)
    assert time.monotonic() - start >= 8 * STEP_S
    assert completion.usage.completion_tokens == 8 and completion.choices[0].text


def test_the_benchmark_client_runs_against_the_simulation(sim_url, tmp_path):
    from client.benchmark import main

    argv = ["--url", sim_url, "--workload", "saturate", "--numsamples", "6", "--mean-tokens", "5"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert run["model"] == "sim:gpt2@fixed-step" and run["summary"]["requests_ok"] == 6
    # Streamed gaps are simulated steps: the loop may add to one, delivery may shift one, but on average they
    # cannot be shorter than a step.
    assert run["summary"]["itl_ms"]["mean"] >= STEP_S * 1000 * 0.9
