"""Replicas behind real HAProxy (./cluster.sh): routing by prompt prefix, and surviving a dead replica."""

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import requests

from client.launch import ROOT, free_port, server_env, start_cluster, start_server, stop_server
from model.tokenizer import load_tokenizer

HAPROXY = shutil.which("haproxy", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/usr/local/sbin")
needs_haproxy = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed: apt-get install haproxy")
TOKENIZER = load_tokenizer()
WORDS = "the lighthouse keeper watched ships pass in a storm at night while gulls cried over grey water".split()
SYSTEM = "You are the keeper of a lighthouse on a rocky coast. Answer every question in one short sentence."


class Cluster(NamedTuple):
    url: str  # HAProxy
    replicas: dict[str, str]  # X-Replica name -> the replica's own URL
    run_dir: Path  # HAProxy's admin socket is there


def replica_settings(tiny_checkpoint: Path) -> dict[str, str]:
    return {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "2048"}


def fake_gpus(directory: Path, indices: list[int]) -> str:
    """A PATH on which nvidia-smi lists these GPU indices (none of which a test machine has)."""
    fake = directory / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + "".join(f"echo {i}\n" for i in indices))
    fake.chmod(0o755)
    return f"{directory}:{os.environ['PATH']}"


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, tmp_path_factory):
    if HAPROXY is None:
        pytest.skip("haproxy is not installed: apt-get install haproxy")
    run_dir = tmp_path_factory.mktemp("cluster")
    settings = {"RUN_DIR": str(run_dir), "PATH": fake_gpus(run_dir, [7, 8, 9]), "CUDA_VISIBLE_DEVICES": ""}
    proc, url = start_cluster(["3", "dynamic"], run_dir, **settings, **replica_settings(tiny_checkpoint))
    port = int(url.rsplit(":", 1)[1])
    try:
        yield Cluster(url, {f"127.0.0.1:{port + i}": f"http://127.0.0.1:{port + i}" for i in (1, 2, 3)}, run_dir)
    finally:
        stop_server(proc)


def start_replicas(log_dir: Path, *settings: dict[str, str]) -> list[tuple[subprocess.Popen, str]]:
    """Replicas started by the test, not by cluster.sh (HAProxy is then given them in REPLICAS_AT)."""
    with ThreadPoolExecutor(len(settings)) as pool:
        return list(pool.map(lambda s: start_server("dynamic", log_dir, **s), settings))


def generate(url: str, endpoint: str, body: dict | str) -> requests.Response:
    """POST a body (a dict, or JSON text as a client wrote it); the response, checked to be 200."""
    data = body if isinstance(body, str) else json.dumps(body)
    response = requests.post(f"{url}{endpoint}", data=data, headers={"Content-Type": "application/json"}, timeout=120)
    assert response.status_code == 200, response.text
    return response


def completed(cluster: Cluster) -> dict[str, int]:
    """Requests completed so far, as each replica's own /stats counts them."""
    stats = {name: requests.get(f"{url}/stats", timeout=10).json() for name, url in cluster.replicas.items()}
    return {name: replica["requests_completed"] for name, replica in stats.items()}


ENDPOINTS = ["/inference", "/v1/completions"]


def ask(endpoint: str, prompt: str, num_tokens: int = 2) -> dict:
    return {"prompt": prompt, "num_tokens" if endpoint == "/inference" else "max_tokens": num_tokens}


def haproxy_view(run_dir: Path) -> dict[str, dict[str, str]]:
    """HAProxy's `show stat` for the replicas backend (each server, and BACKEND), from its admin socket."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(run_dir / "haproxy.sock"))
        sock.sendall(b"show stat\n")
        header, *lines = b"".join(iter(lambda: sock.recv(65536), b"")).decode().splitlines()
    rows = [dict(zip(header.removeprefix("# ").split(","), line.split(","))) for line in lines if line]
    return {row["svname"]: row for row in rows if row["pxname"] == "replicas"}


def poll(condition, deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {deadline_s} s"
        time.sleep(0.01)  # polling interval under a deadline


def send_alone(cluster: Cluster, endpoint: str, body: dict | str) -> str:
    """The replica that answers, sent when HAProxy counts no request in flight (a finished one can
    count for a moment): every replica is then equally loaded, and the key alone decides."""
    servers = lambda: [row for name, row in haproxy_view(cluster.run_dir).items() if name != "BACKEND"]
    poll(lambda: all(row["scur"] == "0" for row in servers()), 10, "requests still in flight")
    return generate(cluster.url, endpoint, body).headers["X-Replica"]


def replica_for(cluster: Cluster, prompt: str) -> str:
    return send_alone(cluster, "/inference", ask("/inference", prompt))


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@needs_haproxy
def test_a_shared_prefix_stays_on_one_replica_and_different_beginnings_spread(cluster):
    rng = random.Random(7)
    before = completed(cluster)
    served = Counter()

    def send(endpoint: str, body: dict | str) -> str:
        name = send_alone(cluster, endpoint, body)
        served[name] += 1
        return name

    # /inference and /v1/completions both carry "prompt", and share the key.
    text = {send(endpoint, ask(endpoint, f"{SYSTEM} {words(rng, 8)}?")) for endpoint in ENDPOINTS * 4}
    prefix_ids = TOKENIZER.encode(SYSTEM)
    ids = {
        send("/v1/completions", json.dumps({"prompt": prefix_ids + [i], "max_tokens": 3}, separators=separators))
        for i, separators in enumerate([(",", ":"), (", ", ": ")] * 4)  # one client writes "[1,2", another "[1, 2"
    }
    beginnings = [f"{words(rng, 6)} {words(rng, 4)}".capitalize() for _ in range(30)]
    assert len({b.encode()[:16] for b in beginnings}) == 30  # different first blocks, so different keys
    spread = Counter(send(endpoint, ask(endpoint, b)) for endpoint, b in zip(ENDPOINTS * 15, beginnings))

    assert len(text) == 1 and len(ids) == 1
    assert set(spread) == set(cluster.replicas)
    after = completed(cluster)
    assert {name: after[name] - before[name] for name in after} == served  # /stats and X-Replica agree
    total = requests.get(f"{cluster.url}/stats", timeout=10).json()  # the balancer's: the aggregate
    assert set(total["replicas"]) == set(cluster.replicas) and total["replicas_answering"] == 3
    assert total["requests_completed"] == sum(after.values())
    assert all(total["replicas"][name]["requests_completed"] == after[name] for name in after)


@needs_haproxy
def test_a_hot_prefix_spills_over_to_other_replicas(cluster):
    """48 requests at once on one prefix: the bounded load keeps one replica from taking them all."""
    prompts = [f"{SYSTEM} Question {i}: why?" for i in range(48)]

    def send(prompt: str) -> str:
        return generate(cluster.url, "/inference", {"prompt": prompt, "num_tokens": 64}).headers["X-Replica"]

    with ThreadPoolExecutor(48) as pool:
        served = Counter(pool.map(send, prompts))
    assert len(served) >= 2 and max(served.values()) <= 36, served


@needs_haproxy
def test_removing_a_replica_moves_only_its_prefixes(cluster, tmp_path):
    """Consistent hashing: a balancer without one replica sends every other prefix where it went before."""
    kept = sorted(cluster.replicas)[:2]
    proc, url = start_cluster([], tmp_path, REPLICAS_AT=",".join(kept), RUN_DIR=str(tmp_path))
    smaller = Cluster(url, {name: cluster.replicas[name] for name in kept}, tmp_path)
    try:
        rng = random.Random(11)
        prompts = [f"{words(rng, 6).capitalize()} {i}" for i in range(30)]
        answered = [(replica_for(cluster, p), replica_for(smaller, p)) for p in prompts]
    finally:
        stop_server(proc)
    moved = [(before, after) for before, after in answered if before != after]
    assert moved and all(before not in kept for before, _ in moved), answered


@needs_haproxy
def test_each_replica_gets_its_own_gpu(cluster):
    """Replica i sees GPU i alone: its environment, as Linux shows it in /proc."""
    gpus = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):  # processes come and go
            env = dict(v.split("=", 1) for v in environ.read_bytes().decode(errors="replace").split("\0") if "=" in v)
            if env.get("REPLICA_NAME") in cluster.replicas:
                gpus.setdefault(env["REPLICA_NAME"], set()).add(env.get("CUDA_VISIBLE_DEVICES"))
    assert gpus == {name: {gpu} for name, gpu in zip(sorted(cluster.replicas), ["7", "8", "9"])}


@needs_haproxy
def test_greedy_output_through_the_balancer_equals_a_direct_request(cluster, hf_greedy):
    prompts = ["The lighthouse keeper", f"{SYSTEM} Who are you?", "Gulls cried over grey water at night"]
    for prompt in prompts:
        body = {"prompt": prompt, "num_tokens": 24, "temperature": 0}
        balanced = generate(cluster.url, "/inference", body)
        other = next(url for name, url in cluster.replicas.items() if name != balanced.headers["X-Replica"])
        direct = generate(other, "/inference", body).json()
        assert balanced.json()["token_ids"] == direct["token_ids"] == hf_greedy(TOKENIZER.encode(prompt), 24)


def stream_events(response: requests.Response):
    for line in response.iter_lines():
        if line.startswith(b"data: {"):
            yield json.loads(line.removeprefix(b"data: "))


@needs_haproxy
def test_a_streamed_request_through_the_balancer_equals_the_non_streamed_one(cluster):
    body = {"prompt": "Ships pass in a storm", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    whole = generate(cluster.url, "/v1/completions", body).json()["choices"][0]
    streamed = generate(cluster.url, "/v1/completions", {**body, "stream": True})
    events = [event["choices"][0] for event in stream_events(streamed)]
    assert streamed.headers["Content-Type"].startswith("text/event-stream")
    assert "".join(e["text"] for e in events) == whole["text"] and len(events) > 2
    assert events[-1]["finish_reason"] == whole["finish_reason"] == "length"


@needs_haproxy
def test_streamed_events_pass_the_balancer_as_they_come_and_a_hang_up_cancels(cluster):
    """The first event arrives while the replica is still generating; closing the stream frees it."""
    body = {"prompt": "A long night", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    with requests.post(f"{cluster.url}/v1/completions", json=body, stream=True, timeout=120) as response:
        replica = cluster.replicas[response.headers["X-Replica"]]
        failed = requests.get(f"{replica}/stats", timeout=10).json()["requests_failed"]
        assert next(stream_events(response))["choices"][0]["text"]
        assert requests.get(f"{replica}/stats", timeout=10).json()["requests_running"] == 1
    deadline = time.monotonic() + 30
    while (stats := requests.get(f"{replica}/stats", timeout=10).json())["requests_running"]:
        assert time.monotonic() < deadline, "the hang-up did not reach the replica"
        time.sleep(0.05)  # polling interval under a deadline
    assert stats["requests_failed"] == failed + 1  # cancelled, not run to the end


@needs_haproxy
def test_the_benchmark_runs_against_the_cluster(cluster, tmp_path):
    from client.benchmark import main

    argv = ["--url", cluster.url, "--workload", "shared-prefix", "--numsamples", "6", "--mean-tokens", "4"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert run["summary"]["requests_ok"] == 6 and set(run["server_stats"]["replicas"]) == set(cluster.replicas)


@needs_haproxy
def test_a_dead_replica_is_routed_around_taken_out_and_put_back(tiny_checkpoint, tmp_path):
    """REPLICAS_AT: HAProxy in front of replicas started elsewhere (here: by the test, to kill one)."""
    settings = replica_settings(tiny_checkpoint)
    (doomed, doomed_url), (survivor, survivor_url) = start_replicas(tmp_path, settings, settings)
    victim, other = doomed_url.removeprefix("http://"), survivor_url.removeprefix("http://")
    balancer = None
    try:
        balancer, url = start_cluster([], tmp_path, REPLICAS_AT=f"{victim},{other}", RUN_DIR=str(tmp_path))
        pair = Cluster(url, {victim: doomed_url, other: survivor_url}, tmp_path)
        prompt = next(p for p in (f"Prompt number {i}, keyed" for i in range(100)) if replica_for(pair, p) == victim)
        status = lambda: haproxy_view(tmp_path)[victim]["status"]

        os.killpg(doomed.pid, signal.SIGKILL)  # its port closes at once; HAProxy has not checked yet
        doomed.wait()
        assert [replica_for(pair, prompt) for _ in range(5)] == [other] * 5  # refused, then sent to the other
        poll(lambda: status().startswith("DOWN"), 10, "not taken out")

        doomed, _ = start_server("dynamic", tmp_path, port=int(victim.rsplit(":", 1)[1]), **settings)
        poll(lambda: status().startswith("UP"), 10, "not put back")
        assert replica_for(pair, prompt) == victim  # its keys come back to it
    finally:
        for proc in (balancer, doomed, survivor):
            if proc is not None and proc.poll() is None:
                stop_server(proc)


@needs_haproxy
def test_a_request_a_full_replica_refuses_is_served_by_another(tiny_checkpoint, tmp_path):
    settings = replica_settings(tiny_checkpoint)
    (full, full_url), (ok, ok_url) = start_replicas(tmp_path, {**settings, "MAX_WAITING": "0"}, settings)
    balancer = None  # the full one refuses everything: 503
    try:
        addresses = f"{full_url.removeprefix('http://')},{ok_url.removeprefix('http://')}"
        balancer, url = start_cluster([], tmp_path, REPLICAS_AT=addresses, RUN_DIR=str(tmp_path))
        assert requests.post(f"{full_url}/inference", json=ask("/inference", "Hello"), timeout=60).status_code == 503
        prompts = [f"{words(random.Random(i), 5)} {i}" for i in range(12)]  # keyed to both replicas
        served = {generate(url, "/inference", ask("/inference", p)).headers["X-Replica"] for p in prompts}
        assert served == {ok_url.removeprefix("http://")}
    finally:
        for proc in (balancer, ok, full):
            if proc is not None:
                stop_server(proc)


@needs_haproxy
def test_sigterm_stops_the_cluster_after_its_requests_finish(tiny_checkpoint, tmp_path):
    proc, url = start_cluster(["1", "dynamic"], tmp_path, RUN_DIR=str(tmp_path), **replica_settings(tiny_checkpoint))
    port = int(url.rsplit(":", 1)[1])
    try:
        with ThreadPoolExecutor(1) as pool:
            body = {"prompt": "Keep going", "num_tokens": 400, "temperature": 0}
            running = pool.submit(requests.post, f"{url}/inference", json=body, timeout=120)
            poll(lambda: requests.get(f"{url}/stats", timeout=10).json()["requests_running"] == 1, 30, "never ran")
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            assert running.result().status_code == 200  # the replica finished it before going
        for p in (port, port + 1):  # HAProxy and the replica are gone
            with pytest.raises(requests.ConnectionError):
                requests.get(f"http://127.0.0.1:{p}/health", timeout=10)
    finally:
        if proc.poll() is None:
            stop_server(proc)


@needs_haproxy
def test_the_balancers_stats_pass_the_api_key_on(tiny_checkpoint, tmp_path):
    settings = {**replica_settings(tiny_checkpoint), "API_KEY": "sesame"}
    proc, url = start_cluster(["1", "dynamic"], tmp_path, RUN_DIR=str(tmp_path), **settings)  # /health is open
    try:
        refused = requests.get(f"{url}/stats", timeout=10)
        stats = requests.get(f"{url}/stats", headers={"Authorization": "Bearer sesame"}, timeout=10)
    finally:
        stop_server(proc)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert stats.status_code == 200 and stats.json()["replicas_answering"] == 1


def run_cluster_sh(*args: str, **settings: str) -> subprocess.CompletedProcess:
    env = server_env(**settings)
    return subprocess.run([str(ROOT / "cluster.sh"), *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [[], ["0", "dynamic"], ["2"], ["2", "turbo"], ["two", "dynamic"]])
def test_cluster_sh_refuses_bad_arguments(args):
    result = run_cluster_sh(*args)
    assert result.returncode == 2 and "usage" in result.stderr


def test_cluster_sh_refuses_replicas_at_with_n_and_mode():
    result = run_cluster_sh("2", "dynamic", REPLICAS_AT="127.0.0.1:1")
    assert result.returncode == 1 and "REPLICAS_AT" in result.stderr


def test_cluster_sh_without_haproxy_says_how_to_install_it(tmp_path):
    result = run_cluster_sh("1", "dynamic", HAPROXY=str(tmp_path / "haproxy"))
    assert result.returncode == 1 and "apt-get install haproxy" in result.stderr


@needs_haproxy
def test_cluster_sh_refuses_more_replicas_than_gpus(tmp_path):
    path = fake_gpus(tmp_path, [0, 1])
    result = run_cluster_sh("3", "dynamic", PATH=path, RUN_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 1 and "3 replicas but 2 GPUs" in result.stderr
    limited = run_cluster_sh("2", "dynamic", PATH=path, RUN_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="5")
    assert limited.returncode == 1 and "2 replicas but 1 GPUs" in limited.stderr  # only the GPUs it may use


@needs_haproxy
def test_a_replica_that_cannot_start_stops_the_cluster_with_its_log(tmp_path):
    port = free_port(following=1)
    env = {"MODEL": "gpt2-large", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "PORT": str(port)}
    result = run_cluster_sh("1", "dynamic", RUN_DIR=str(tmp_path), **env)
    assert result.returncode == 1
    assert f"replica 127.0.0.1:{port + 1} exited before it was healthy" in result.stderr
    assert "cannot download 'gpt2-large'" in result.stderr  # the replica's own words, from its log
