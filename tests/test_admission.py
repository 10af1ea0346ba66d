"""Admission that protects latency: bounds on waiting prompt tokens and a TTFT target, refusals at once with
OpenAI's error shape and Retry-After, counted by reason in /stats and /metrics, and nothing lost."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import sim_settings, wait_until
from prometheus_client.parser import text_string_to_metric_families

from batching.admission import Admission, Refused
from config import Settings

TENANT_REASONS = {"tenant_max_waiting": 0, "tenant_max_running": 0}  # none configured here (test_tenants.py)


def admission(**settings) -> Admission:
    return Admission(Settings.of(**settings))


def test_queue_full_then_waiting_tokens_are_refused_with_503_and_counted():
    adm = admission(max_waiting=2, max_waiting_tokens=300)
    adm.check(100, 0, num_waiting=1, queued=[(0, 100)])
    with pytest.raises(Refused) as full:
        adm.check(10, 0, num_waiting=2, queued=[])
    assert full.value.reason == "queue_full" and full.value.status == 503 and full.value.retry_after == 1
    adm.publish(waiting=[], running=[])
    with pytest.raises(Refused) as tokens:
        adm.check(101, 0, num_waiting=1, queued=[(0, 100), (5, 100)])  # 301 tokens would wait
    assert tokens.value.reason == "waiting_tokens" and "301 prompt tokens" in str(tokens.value)
    assert adm.counts() == {"queue_full": 1, "waiting_tokens": 1, "ttft_target": 0} | TENANT_REASONS


def test_ttft_target_counts_the_work_of_its_priority_or_more_urgent_over_the_measured_rate():
    adm = admission(ttft_target_s=2.0)
    adm.check(10_000, 0, num_waiting=0, queued=[])  # no rate measured yet: nothing to estimate from
    adm.observe_step(300, 2.0)
    adm.observe_step(100, 2.0)  # 100 prompt tokens a second
    assert adm.prefill_rate == pytest.approx(100.0)
    queued = [(0, 150), (3, 1000)]
    adm.check(50, 0, num_waiting=2, queued=queued)  # 150 + 50 tokens: 2 s, in time; the priority-3 work can wait
    with pytest.raises(Refused) as late:
        adm.check(51, 0, num_waiting=2, queued=queued)
    assert late.value.status == 429 and late.value.reason == "ttft_target" and late.value.retry_after == 1
    with pytest.raises(Refused) as low:
        adm.check(10, 3, num_waiting=2, queued=queued)  # behind everything: 11.6 s, 9.6 s past the target
    assert low.value.retry_after == 10
    assert adm.counts()["ttft_target"] == 2


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_over_http_a_request_that_could_not_start_in_time_gets_429_at_once_and_the_rest_are_served(make_app, tmp_path):
    step_s, prompt = 0.5, "word " * 100  # sim steps take 0.5 s by the clock; one 101-token prompt a step
    sim = {k.lower(): v for k, v in sim_settings(tmp_path, step_s).items()}
    app, manager = make_app(ttft_target_s=2.5 * step_s, max_batch_tokens=128, **sim)
    client = app.test_client()
    body = {"prompt": prompt, "num_tokens": 1}
    assert client.post("/inference", json=body).status_code == 200  # measures the prefill rate: ~1 prompt a step
    gate, step = threading.Event(), manager.engine.step
    manager.engine.step = lambda: gate.wait() and step()
    with ThreadPoolExecutor(4) as pool:
        try:
            held = []
            for _i in range(2):  # the second has two prompts to prefill before its first token: ~2 steps
                held.append(pool.submit(client.post, "/inference", json=body))
                wait_until(lambda: manager.num_waiting() == len(held))
            refused = client.post("/inference", json=body)  # a third: ~3 steps, past 2.5
            refused_v1 = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            # more urgent than all that waits: only its own prompt to compute, so it is admitted
            urgent = pool.submit(client.post, "/inference", json={**body, "priority": -1})
            wait_until(lambda: manager.num_waiting() == 3)
        finally:
            gate.set()
        answers = [f.result(timeout=60) for f in [*held, urgent]]
    assert [a.status_code for a in answers] == [200, 200, 200]
    for response in (refused, refused_v1):
        error = response.get_json()["error"]
        assert response.status_code == 429 and error["code"] == 429 and error["type"] == "overloaded"
        assert "could not start this request within the 1.25 s target" in error["message"]
        assert int(response.headers["Retry-After"]) >= 1
    stats = client.get("/stats").get_json()
    assert stats["requests_refused"] == {"queue_full": 0, "waiting_tokens": 0, "ttft_target": 2} | TENANT_REASONS
    assert stats["requests_completed"] == 4 and stats["requests_failed"] == 0
    text = client.get("/metrics").get_data(as_text=True)
    assert metric(text, "gpt2_requests_refused_total", reason="ttft_target") == 2


def test_over_http_max_waiting_tokens_refuses_with_503(make_app):
    app, manager = make_app(max_waiting_tokens=250)
    gate, step = threading.Event(), manager.engine.step
    manager.engine.step = lambda: gate.wait() and step()
    client = app.test_client()
    body = {"prompt": "word " * 99, "num_tokens": 2}  # 100 tokens
    with ThreadPoolExecutor(2) as pool:
        try:
            held = []
            for _i in range(2):
                held.append(pool.submit(client.post, "/inference", json=body))
                wait_until(lambda: manager.num_waiting() == len(held))
            refused = client.post("/inference", json=body)
        finally:
            gate.set()
        assert [f.result(timeout=60).status_code for f in held] == [200, 200]
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert "250" in refused.get_json()["error"]["message"]
    assert client.get("/stats").get_json()["requests_refused"]["waiting_tokens"] == 1
