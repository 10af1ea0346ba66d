"""/health tells the truth: 503 when the engine loop is stuck in a step with work pending, and HAProxy then
takes the replica out; an idle server, or one whose steps are merely slow, stays healthy."""

import threading

import pytest
import requests
from conftest import sim_settings, wait_until
from test_cluster import haproxy_view, needs_haproxy, poll, start_replicas

from batching.telemetry import heartbeat
from batching.telemetry.heartbeat import Heartbeat
from client.launch import start_cluster, stop_server


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(heartbeat, "time", clock)
    return clock


def test_stalled_only_with_work_pending_past_the_limit(clock):
    beat = Heartbeat(stall_s=30, first_step_s=300)
    clock.now += 299
    assert beat.stalled(pending=3) is None  # the first step may compile for up to 300 s
    clock.now += 2
    assert "no step finished for 301 s with 3 requests pending" in beat.stalled(pending=3)
    beat.step_done(0.5)
    clock.now += 29
    assert beat.stalled(pending=3) is None
    clock.now += 2
    assert beat.stalled(pending=3) and beat.stalled(pending=0) is None  # idle is not stuck


def test_the_limit_grows_with_the_slowest_step_and_waking_restarts_the_wait(clock):
    beat = Heartbeat(stall_s=30, first_step_s=300)
    beat.step_done(20.0)  # a big model on a CPU: 20 s steps are normal, 60 s are not yet a hang
    clock.now += 59
    assert beat.stalled(pending=1) is None
    clock.now += 2
    assert beat.stalled(pending=1)
    beat.wake()  # work came to an idle loop: its wait starts now
    assert beat.stalled(pending=1) is None


def test_a_hung_step_turns_health_503_and_shutdown_answers_its_request(make_app):
    app, manager = make_app(fault_hang_at_step=1, engine_stall_s=0.2, engine_first_step_s=0.2)
    client = app.test_client()
    assert client.get("/health").status_code == 200
    answers = []
    thread = threading.Thread(
        target=lambda: answers.append(client.post("/inference", json={"prompt": "hang", "num_tokens": 2}))
    )
    thread.start()
    wait_until(lambda: client.get("/health").status_code == 503, 30)
    reply = client.get("/health").get_json()
    assert reply["status"] == "unavailable" and "engine loop is stuck" in reply["reason"]
    manager.shut_down(0)
    thread.join(30)
    assert answers[0].status_code == 500  # answered once, with an error, not left hanging


@needs_haproxy
def test_haproxy_takes_a_replica_with_a_hung_engine_out(tmp_path):
    settings = sim_settings(tmp_path, step_s=0.01)
    hung = {**settings, "FAULT_HANG_AT_STEP": "3", "ENGINE_STALL_S": "1", "ENGINE_FIRST_STEP_S": "1"}
    (victim_proc, victim_url), (other_proc, other_url) = start_replicas(tmp_path, hung, settings)
    victim, other = victim_url.removeprefix("http://"), other_url.removeprefix("http://")
    balancer = None
    try:
        balancer, url = start_cluster([], tmp_path, REPLICAS_AT=f"{victim},{other}", RUN_DIR=str(tmp_path))
        status = lambda: haproxy_view(tmp_path)[victim]["status"]
        poll(lambda: status().startswith("UP"), 10, "the victim never up")
        stuck = threading.Thread(
            target=requests.post, args=(f"{victim_url}/inference",), kwargs={"json": {"prompt": "x", "num_tokens": 9}}
        )
        stuck.start()  # its third step hangs
        poll(lambda: requests.get(f"{victim_url}/health", timeout=5).status_code == 503, 30, "health not 503")
        poll(lambda: status().startswith("DOWN"), 15, "HAProxy did not take the hung replica out")
        for i in range(6):
            body = {"prompt": f"after {i} the hang", "num_tokens": 2}
            response = requests.post(f"{url}/inference", json=body, timeout=60)
            assert response.status_code == 200 and response.headers["X-Replica"] == other
    finally:
        for proc in (balancer, victim_proc, other_proc):
            if proc is not None:
                stop_server(proc)
