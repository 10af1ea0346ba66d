"""A server that survives its clients: garbage, a soak at 256 in flight, and SIGTERM under load."""

import json
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from client.launch import running_server, start_server, stop_server


@pytest.fixture(scope="module")
def url(tiny_checkpoint, tmp_path_factory):
    env = {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "4096", "MAX_BATCH_SIZE": "256"}
    with running_server("dynamic", tmp_path_factory.mktemp("logs"), **env) as url:
        yield url


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
SMALL = st.integers(-3, 24) | JSON  # token counts: mostly cheap, sometimes nonsense
TOKEN_IDS = st.lists(st.integers(-2, 60000), max_size=5)
PENALTY = st.floats(-3, 3) | st.floats(-150, 150) | JSON
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)})
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | JSON,
        "content": st.text(max_size=20)
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2)
        | JSON,
        "name": st.text(max_size=5),
    },
)
SCHEMA = st.sampled_from([{"type": "object"}, {"type": "integer", "maximum": 99}, {"type": "nope"}, {"enum": [1, "a"]}])
TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "bad name"])})},
)
FIELDS = {
    "prompt": st.text(max_size=40) | TOKEN_IDS | st.lists(st.text(max_size=10) | TOKEN_IDS, max_size=3) | JSON,
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "tokens": TOKEN_IDS | JSON,
    "num_tokens": SMALL,
    "max_tokens": SMALL,
    "max_completion_tokens": SMALL,
    "min_tokens": SMALL,
    "temperature": st.floats(-1, 3) | JSON,
    "top_k": st.integers(-2, 60000) | JSON,
    "top_p": st.floats(-0.5, 1.5) | JSON,
    "seed": st.integers(-5, 2**64) | JSON,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6) | JSON,
    "stop_at_eos": JSON,
    "ignore_eos": JSON,
    "n": st.integers(0, 4) | JSON,
    "best_of": st.integers(0, 4) | JSON,
    "echo": st.booleans() | JSON,
    "logprobs": st.integers(-1, 6) | st.booleans() | JSON,
    "top_logprobs": st.integers(-1, 21) | JSON,
    "logit_bias": st.dictionaries(
        st.integers(-1, 60000).map(str) | st.text(max_size=3), st.floats(-150, 150) | JSON, max_size=3
    )
    | JSON,
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    "repetition_penalty": PENALTY,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON}) | JSON,
    "stream_interval": st.integers(-1, 3) | JSON,
    "suffix": st.text(max_size=3),
    "user": st.text(max_size=5) | JSON,
    "model": st.text(max_size=10) | JSON,
    "guided_json": SCHEMA | SCHEMA.map(json.dumps) | JSON,
    "guided_regex": st.sampled_from(["[a-c]{1,5}", "(", "\\d+", ""]) | JSON,
    "guided_choice": st.lists(st.text(max_size=4), max_size=3) | JSON,
    "guided_grammar": st.sampled_from(['start: "a" | "b"', 'root ::= "x"+', "start: undefined"]) | JSON,
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
        optional={"json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": SCHEMA})},
    )
    | JSON,
    "tools": st.lists(TOOL, max_size=2) | JSON,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | JSON,
}
BODIES = st.fixed_dictionaries({}, optional=FIELDS) | JSON
ENDPOINTS = ["/inference", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES, endpoint=st.sampled_from(ENDPOINTS))
def test_random_json_gets_a_json_4xx_or_an_answer(url, body, endpoint):
    response = requests.post(
        f"{url}{endpoint}", data=json.dumps(body), timeout=60, headers={"Content-Type": "application/json"}
    )
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        payload = response.json()
        assert 400 <= response.status_code < 500 and payload["error"]["message"]
    elif response.headers["Content-Type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line]
        assert events[-1] == "data: [DONE]" and all('"error"' not in e for e in events)
    else:
        assert_answer_shape(endpoint, response.json())


def assert_answer_shape(endpoint: str, payload: dict) -> None:
    if endpoint == "/inference":
        assert isinstance(payload["completion"], str)
    elif endpoint == "/v1/completions":
        assert all(isinstance(c["text"], str) for c in payload["choices"]) and payload["choices"]
    elif endpoint == "/v1/chat/completions":
        messages = [c["message"] for c in payload["choices"]]
        assert all(isinstance(m["content"], str) or m["tool_calls"] for m in messages) and messages
    elif endpoint == "/tokenize":
        assert payload["count"] == len(payload["tokens"])
    else:
        assert isinstance(payload["prompt"], str)


def test_still_serving_after_the_fuzz(url):
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    ok = requests.post(f"{url}/inference", json={"prompt": "hello", "num_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["completion_tokens"] == 3


def metric(url: str, name: str, **labels: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def test_soak_1000_requests_at_256_in_flight_all_answered_and_counted(url):
    rng = random.Random(5)
    counts = [rng.randint(1, 8) for _ in range(1000)]
    stats_before = requests.get(f"{url}/stats", timeout=10).json()
    ok_before = metric(url, "gpt2_requests_total", outcome="ok")
    tokens_before = metric(url, "gpt2_generated_tokens_total")

    def one(i: int) -> int:
        body = {"prompt": f"request number {i}", "num_tokens": counts[i], "temperature": 0.7, "seed": i}
        response = requests.post(f"{url}/inference", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()["completion_tokens"]

    with ThreadPoolExecutor(256) as pool:
        assert list(pool.map(one, range(1000))) == counts
    stats = requests.get(f"{url}/stats", timeout=10).json()
    assert stats["requests_completed"] - stats_before["requests_completed"] == 1000
    assert stats["tokens_generated"] - stats_before["tokens_generated"] == sum(counts)
    assert metric(url, "gpt2_requests_total", outcome="ok") - ok_before == 1000
    assert metric(url, "gpt2_generated_tokens_total") - tokens_before == sum(counts)
    assert stats["requests_failed"] == stats_before["requests_failed"]


def test_sigterm_under_load_exits_in_grace_and_leaves_no_client_hanging(tiny_checkpoint, tmp_path):
    grace = 3
    env = {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "4096", "SHUTDOWN_GRACE_S": str(grace)}
    proc, url = start_server("dynamic", tmp_path, **env)
    try:

        def one(num_tokens: int) -> str:
            try:
                body = {"prompt": "keep going", "num_tokens": num_tokens, "temperature": 0}
                return str(requests.post(f"{url}/inference", json=body, timeout=120).status_code)
            except requests.ConnectionError:
                return "closed"

        with ThreadPoolExecutor(64) as pool:
            futures = [pool.submit(one, n) for n in [2] * 16 + [1000] * 48]
            deadline = time.monotonic() + 60
            while requests.get(f"{url}/stats", timeout=10).json()["requests_running"] < 48:
                assert time.monotonic() < deadline, "load never built up"
                time.sleep(0.05)  # polling interval under a deadline
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=grace + 30)
            exited_after = time.monotonic() - sent
            done, hanging = wait(futures, timeout=30)
        assert not hanging
        outcomes = [f.result() for f in done]
        assert exited_after < grace + 15
        assert outcomes.count("200") >= 16  # the short ones finished
        assert set(outcomes) <= {"200", "500", "503", "closed"}
    finally:
        if proc.poll() is None:
            stop_server(proc)


def in_flight(url: str) -> int:
    stats = requests.get(f"{url}/stats", timeout=10).json()
    return stats["requests_running"] + stats["requests_waiting"]


def test_health_answers_within_a_second_with_500_requests_in_flight(tiny_checkpoint, tmp_path):
    """A load balancer takes out a replica whose /health is slow: a busy replica must answer it at once.

    64 running and 436 waiting requests, 500 in flight, are all the server admits; 40 more clients are
    beyond MAX_WAITING and must be refused at once, not queue for a thread (where /health would queue too).
    """
    clients, admitted = 540, 64 + 436
    env = {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "8192", "MAX_BATCH_SIZE": "64", "MAX_WAITING": "436"}
    proc, url = start_server("dynamic", tmp_path, SHUTDOWN_GRACE_S="1", **env)
    try:

        def one(i: int) -> str:
            try:
                body = {"prompt": f"request {i}", "num_tokens": 900, "temperature": 0}
                return str(requests.post(f"{url}/inference", json=body, timeout=120).status_code)
            except requests.ConnectionError:
                return "closed"

        with ThreadPoolExecutor(clients) as pool:
            futures = [pool.submit(one, i) for i in range(clients)]
            refused = lambda: sum(f.done() and f.result() == "503" for f in futures)
            deadline = time.monotonic() + 60
            while in_flight(url) < admitted or refused() < clients - admitted:
                assert time.monotonic() < deadline, f"{in_flight(url)} in flight, {refused()} refused"
                time.sleep(0.05)  # polling interval under a deadline
            latencies = []
            for _ in range(5):  # spread over the load: a few engine steps apart
                steps = requests.get(f"{url}/stats", timeout=10).json()["steps"]
                sent = time.monotonic()
                assert requests.get(f"{url}/health", timeout=10).status_code == 200
                latencies.append(time.monotonic() - sent)
                while requests.get(f"{url}/stats", timeout=10).json()["steps"] < steps + 3:
                    time.sleep(0.01)  # polling interval; the request timeouts bound it
            assert in_flight(url) == admitted  # the load lasted the whole measurement
            stop_server(proc)  # its graceful shutdown answers the rest
        assert max(latencies) < 1.0, latencies
    finally:
        if proc.poll() is None:
            stop_server(proc)
