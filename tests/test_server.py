"""End to end: the real ./server.sh (gunicorn) serving a checkpoint written by transformers."""

import json
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from client.launch import ROOT, running_server, server_env
from model.cpu_features import BFLOAT16_FLAGS, cpu_flags
from model.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer()
WORDS = "the lighthouse keeper watched ships pass in a storm at night while gulls cried over grey water".split()


def text_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))).capitalize() for _ in range(n)]


def post(url: str, body, **kwargs) -> requests.Response:
    return requests.post(f"{url}/inference", json=body, timeout=120, **kwargs)


def greedy_all(url: str, prompts: list[str], counts: list[int], workers: int) -> list[dict]:
    def one(args):
        response = post(url, {"prompt": args[0], "num_tokens": args[1], "temperature": 0})
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, zip(prompts, counts)))


@pytest.fixture(scope="module")
def settings(tiny_checkpoint) -> dict[str, str]:
    return {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "2048", "MAX_BODY_BYTES": "65536"}


@pytest.fixture(scope="module")
def dynamic(settings, tmp_path_factory):
    with running_server("dynamic", tmp_path_factory.mktemp("logs"), **settings) as url:
        yield url


@pytest.mark.parametrize("engine_process", ["off", "on"])  # on: the engine in a process of its own
@pytest.mark.parametrize("mode", ["nobatch", "static", "dynamic"])
def test_greedy_output_equals_transformers_in_every_mode(mode, engine_process, settings, hf_greedy, tmp_path):
    prompts, counts = text_prompts(8, seed=1), [1, 40, 17, 33, 2, 25, 40, 9]
    with running_server(mode, tmp_path, **settings, ENGINE_PROCESS=engine_process) as url:
        results = greedy_all(url, prompts, counts, workers=8)
        stats = requests.get(f"{url}/stats", timeout=10).json()
    for prompt, n, result in zip(prompts, counts, results):
        prompt_ids = TOKENIZER.encode(prompt)
        assert result["token_ids"] == hf_greedy(prompt_ids, n)
        assert result["text"] == TOKENIZER.decode(result["token_ids"])
        assert result["completion"] == prompt + result["text"]
        assert (result["prompt_tokens"], result["completion_tokens"]) == (len(prompt_ids), n)
        assert 0 < result["ttft_s"] <= result["latency_s"]
    assert stats["mode"] == mode
    assert (stats["requests_completed"], stats["tokens_generated"]) == (8, sum(counts))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's default dtype")
def test_with_dtype_unset_the_server_runs_bfloat16_where_the_cpu_computes_it_and_says_so(
    settings, tmp_path, monkeypatch
):
    monkeypatch.delenv("DTYPE", raising=False)
    with running_server("dynamic", tmp_path, **settings) as url:
        device = requests.get(f"{url}/stats/timeline", timeout=10).json()["server"]["device"]
        result = post(url, {"prompt": "The lighthouse keeper", "num_tokens": 5, "temperature": 0}).json()
    expected = "bfloat16" if cpu_flags() & set(BFLOAT16_FLAGS) else "float32"  # /proc/cpuinfo, not torch's probe
    assert device == f"cpu {expected}"
    assert f"DTYPE unset: torch.{expected}" in "".join(p.read_text() for p in tmp_path.glob("server-*.log"))
    assert len(result["token_ids"]) == 5


def test_64_concurrent_requests_each_equal_their_answer_alone(dynamic, hf_greedy):
    rng = random.Random(2)
    prompts, counts = text_prompts(64, seed=3), [rng.randint(1, 48) for _ in range(64)]
    together = greedy_all(dynamic, prompts, counts, workers=64)
    alone = greedy_all(dynamic, prompts, counts, workers=1)
    assert [r["token_ids"] for r in together] == [r["token_ids"] for r in alone]
    assert [r["token_ids"] for r in alone] == [hf_greedy(TOKENIZER.encode(p), n) for p, n in zip(prompts, counts)]


def test_stats_count_what_was_sent(dynamic):
    before = requests.get(f"{dynamic}/stats", timeout=10).json()
    counts = [5, 1, 12, 7]
    greedy_all(dynamic, text_prompts(4, seed=4), counts, workers=4)
    post(dynamic, {"prompt": "", "num_tokens": 3})  # refused: counts nowhere
    after = requests.get(f"{dynamic}/stats", timeout=10).json()
    assert after["requests_completed"] - before["requests_completed"] == 4
    assert after["tokens_generated"] - before["tokens_generated"] == sum(counts)
    assert after["total-tokens-handled"] == after["tokens_generated"]
    assert after["requests_failed"] == before["requests_failed"]
    assert after["requests_running"] == after["requests_waiting"] == after["kv_blocks_used"] == 0
    assert after["throughput"] > 0 and after["latency_s"]["p99"] >= after["latency_s"]["p50"] > 0
    assert {"latency-per-token", "total-elapsed-time", "ttft_s", "tpot_s", "kv_blocks_total"} <= after.keys()


def test_seeded_sampling_is_reproducible_over_http(dynamic):
    body = {"prompt": "Once upon a time", "num_tokens": 20, "temperature": 0.9, "top_p": 0.9, "top_k": 50}
    a, b = (post(dynamic, {**body, "seed": 7}).json() for _ in range(2))
    c = post(dynamic, {**body, "seed": 8}).json()
    assert a["token_ids"] == b["token_ids"] != c["token_ids"]


BAD_BODIES = [
    ([1, 2], "JSON object"),
    ({"num_tokens": 5}, "'prompt'"),
    ({"prompt": 5, "num_tokens": 5}, "'prompt'"),
    ({"prompt": "", "num_tokens": 5}, "'prompt'"),
    ({"prompt": "hi"}, "'num_tokens'"),
    ({"prompt": "hi", "num_tokens": 0}, "'num_tokens'"),
    ({"prompt": "hi", "num_tokens": -3}, "'num_tokens'"),
    ({"prompt": "hi", "num_tokens": 2.5}, "'num_tokens'"),
    ({"prompt": "hi", "num_tokens": True}, "'num_tokens'"),
    ({"prompt": "hi", "num_tokens": "5"}, "'num_tokens'"),
    ({"prompt": "hi", "num_tokens": 1024}, "1024-token context"),
    ({"prompt": "hi " * 1100, "num_tokens": 1}, "1024-token context"),
    ({"prompt": "hi", "num_tokens": 5, "temperature": -1}, "'temperature'"),
    ({"prompt": "hi", "num_tokens": 5, "temperature": "hot"}, "'temperature'"),
    ({"prompt": "hi", "num_tokens": 5, "top_p": 0}, "'top_p'"),
    ({"prompt": "hi", "num_tokens": 5, "top_p": 1.5}, "'top_p'"),
    ({"prompt": "hi", "num_tokens": 5, "top_k": -1}, "'top_k'"),
    ({"prompt": "hi", "num_tokens": 5, "seed": "x"}, "'seed'"),
    ({"prompt": "hi", "num_tokens": 5, "stop_at_eos": "yes"}, "'stop_at_eos'"),
]


@pytest.mark.parametrize(("body", "names"), BAD_BODIES)
def test_bad_input_gets_400_naming_the_field(dynamic, body, names):
    response = post(dynamic, body)
    assert response.status_code == 400
    assert names in response.json()["error"]["message"]
    assert post(dynamic, {"prompt": "still serving", "num_tokens": 2}).status_code == 200


def test_nan_is_refused(dynamic):
    raw = '{"prompt": "hi", "num_tokens": 3, "temperature": NaN}'
    response = requests.post(f"{dynamic}/inference", data=raw, headers={"Content-Type": "application/json"}, timeout=10)
    assert response.status_code == 400 and "'temperature'" in response.json()["error"]["message"]


def test_oversized_unknown_and_wrong_method_get_json_errors(dynamic):
    big = post(dynamic, {"prompt": "x" * 100_000, "num_tokens": 1})
    assert big.status_code == 413 and "error" in big.json()
    missing = requests.get(f"{dynamic}/nowhere", timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = requests.get(f"{dynamic}/inference", timeout=10)
    assert wrong.status_code == 405 and "error" in wrong.json()
    assert requests.get(f"{dynamic}/health", timeout=10).status_code == 200


def test_every_response_names_its_replica(dynamic):
    """Behind a balancer the X-Replica header says who answered: by default the server's host:port."""
    name = dynamic.removeprefix("http://")
    responses = [
        post(dynamic, {"prompt": "who answers", "num_tokens": 2}),
        post(dynamic, {"prompt": "", "num_tokens": 2}),
        requests.get(f"{dynamic}/nowhere", timeout=10),
        requests.get(f"{dynamic}/health", timeout=10),
    ]
    assert [r.status_code for r in responses] == [200, 400, 404, 200]
    assert all(r.headers["X-Replica"] == name for r in responses)


def test_server_sh_refuses_an_unknown_mode():
    result = subprocess.run([str(ROOT / "server.sh"), "turbo"], capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "usage" in result.stderr


def test_unreachable_hub_model_is_one_clear_line(tmp_path):
    env = server_env(MODEL="gpt2-large", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path), PORT="1")
    result = subprocess.run([str(ROOT / "server.sh"), "dynamic"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "cannot download 'gpt2-large'" in result.stderr and "random:gpt2-large" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_an_unchunked_budget_below_one_context_is_one_clear_line(tiny_checkpoint):
    env = server_env(MODEL=str(tiny_checkpoint), CHUNKED_PREFILL="off", MAX_BATCH_TOKENS="512", PORT="1")
    result = subprocess.run([str(ROOT / "server.sh"), "dynamic"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "MAX_BATCH_TOKENS (512) must cover one full context (1024 tokens)" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_no_settings_serves_random_gpt2_medium_and_says_so(tmp_path):
    env = {"MODEL": "", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "KV_CACHE_BLOCKS": "64"}
    with running_server("dynamic", tmp_path, **env) as url:
        health = requests.get(f"{url}/health", timeout=10).json()
        stats = requests.get(f"{url}/stats", timeout=10).json()
    assert health["random_weights"] is True and health["model"] == "random:gpt2-medium"
    assert stats["model"] == "random:gpt2-medium"
    (log,) = tmp_path.glob("server-*.log")
    assert "SERVING RANDOM GPT2-MEDIUM WEIGHTS" in log.read_text()


def test_stream_interval_setting_is_a_floor_for_every_stream_and_zero_is_refused(make_app):
    from config import Settings

    with pytest.raises(ValueError, match="STREAM_INTERVAL"):
        Settings(stream_interval=0)
    app, manager = make_app(stream_interval=4)
    body = {"prompt": "Hello", "max_tokens": 14, "stream": True, "ignore_eos": True, "return_token_ids": True}
    for asked in ({}, {"stream_interval": 2}):  # a request asking for fewer still gets the server's 4
        response = app.test_client().post("/v1/completions", json=body | asked)
        events = response.get_data(as_text=True).split("\n\n")
        counts = [len(json.loads(e[6:])["choices"][0]["token_ids"]) for e in events if e.startswith("data: {")]
        assert sum(counts) == 14 and all(n >= 4 for n in counts[1:-1]), counts
        assert len(counts) <= 1 + -(-13 // 4), counts  # the first, then one per 4 tokens (the last may be short)


def test_switch_interval_ms_sets_the_gil_switch_interval_and_a_negative_one_is_refused(make_app):
    import sys

    from config import Settings

    with pytest.raises(ValueError, match="SWITCH_INTERVAL_MS"):
        Settings(switch_interval_ms=-1)
    before = sys.getswitchinterval()
    try:
        app, manager = make_app(switch_interval_ms=0.5)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        response = app.test_client().post("/inference", json={"prompt": "Hello", "num_tokens": 2})
        assert response.status_code == 200, response.get_json()
    finally:
        sys.setswitchinterval(before)
