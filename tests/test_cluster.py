"""Replicas behind real HAProxy (./cluster.sh): routing by prompt prefix, and surviving a dead replica."""

import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import NamedTuple

import pytest
import requests
from conftest import sim_settings

from client.launch import ROOT, free_port, server_env, start_cluster, start_server, stop_server
from client.workloads import build, group_system_prompts
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
def test_balance_roundrobin_sends_one_prefix_to_every_replica_in_turn(cluster, tmp_path):
    """BALANCE=roundrobin, what a generic balancer does (the benchmark measures routing by prefix against it)."""
    addresses = ",".join(cluster.replicas)
    proc, url = start_cluster([], tmp_path, REPLICAS_AT=addresses, RUN_DIR=str(tmp_path), BALANCE="roundrobin")
    try:
        served = Counter(replica_for(Cluster(url, cluster.replicas, tmp_path), f"{SYSTEM} Why?") for _ in range(6))
    finally:
        stop_server(proc)
    assert served == {name: 2 for name in cluster.replicas}


@needs_haproxy
def test_the_benchmark_compares_prefix_routing_with_round_robin(tmp_path, monkeypatch):
    """--replicas and --balance: a cluster per run, and the prefix cache's hits as the balancer's /stats sum them."""
    from client.benchmark import main

    for name, value in sim_settings(tmp_path, step_s=0.005).items():
        monkeypatch.setenv(name, value)  # the clusters' replicas read their settings from the environment
    groups, n = 3, 24
    argv = ["--workload", "grouped-prefix", "--groups", str(groups), "--numsamples", str(n), "--mean-tokens", "4"]
    argv += ["--max-concurrency", "1", "--replicas", "2", "--balance", "prefix,roundrobin"]
    assert main([*argv, "--out", str(tmp_path / "out"), "--report"]) == 0

    results = json.loads((tmp_path / "out" / "results.json").read_text())
    runs = {run["label"]: run for run in results["runs"]}
    assert list(runs) == ["dynamic 2 replicas prefix", "dynamic 2 replicas roundrobin"]
    systems = group_system_prompts(TOKENIZER, groups)
    prompts = [r.prompt_ids for r in build("grouped-prefix", n, 10.0, 4, groups=groups).requests]
    group_of = [next(g for g, system in enumerate(systems) if p[: len(system)] == system) for p in prompts]
    placed = {}  # run -> the (group, replica) pairs it served
    for label, run in runs.items():
        stats = run["server_stats"]
        assert run["summary"]["requests_ok"] == n and stats["replicas_answering"] == 2
        served = Counter(r["replica"] for r in run["requests"])
        completed = {name: replica["requests_completed"] for name, replica in stats["replicas"].items()}
        # with 3 groups on 2 replicas, every group hashes to one replica in about 1 run of 4: it served none
        assert served == {name: count for name, count in completed.items() if count}
        # One request at a time: a request finds its system prompt's 31 full blocks cached if an earlier one of
        # its group ran on its replica, and nothing if none did (groups differ from their first block on).
        first, repeated = set(), []
        for group, prompt, request in zip(group_of, prompts, run["requests"]):
            if (group, request["replica"]) in first:
                repeated.append(prompt)
            first.add((group, request["replica"]))
        assert len(repeated) * 496 <= stats["prefix_cache_hit_tokens"] <= sum(len(p) - 1 for p in repeated)
        assert stats["prefix_cache_query_tokens"] == sum(map(len, prompts))
        hit_rate = stats["prefix_cache_hit_tokens"] / sum(map(len, prompts))
        assert stats["prefix_cache_hit_rate"] == pytest.approx(hit_rate, abs=1e-6)  # results.json keeps 6 decimals
        # HAProxy relays 24 requests in less than the 10 ms clock tick /proc counts in: its share may read 0
        assert run["cpu"]["server"] > 0 and run["cpu"]["haproxy"] >= 0 and run["cpu"]["client"] > 0
        placed[label] = first
    prefix, roundrobin = runs.values()
    assert sorted(Counter(r["replica"] for r in roundrobin["requests"]).values()) == [n // 2, n // 2]
    assert len(placed["dynamic 2 replicas prefix"]) < len(placed["dynamic 2 replicas roundrobin"])
    assert prefix["server_stats"]["prefix_cache_hit_rate"] > roundrobin["server_stats"]["prefix_cache_hit_rate"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "requests per replica" in report and "](cluster.png)" in report


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
def test_streamed_events_pass_the_balancer_as_they_come_and_a_hang_up_cancels(tmp_path):
    """The first event arrives while the replica is still generating; closing the stream frees it. The replica's
    every step takes 20 ms (the tiny model's 1,000 tokens took ~1.4 s, which a loaded machine's delivery outlasted)."""
    settings = sim_settings(tmp_path, step_s=0.02)
    proc, url = start_cluster(["1", "dynamic"], tmp_path, RUN_DIR=str(tmp_path), **settings)
    try:
        body = {"prompt": "A long night", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as response:
            replica = f"http://{response.headers['X-Replica']}"
            assert next(stream_events(response))["choices"]
            stats = requests.get(f"{replica}/stats", timeout=10).json()
            assert stats["requests_running"] == 1 and stats["requests_failed"] == 0
        deadline = time.monotonic() + 30
        while (stats := requests.get(f"{replica}/stats", timeout=10).json())["requests_running"]:
            assert time.monotonic() < deadline, "the hang-up did not reach the replica"
            time.sleep(0.05)  # polling interval under a deadline
        assert stats["requests_failed"] == 1 and stats["requests_completed"] == 0  # cancelled, not run to the end
    finally:
        stop_server(proc)


@needs_haproxy
def test_streamed_events_pass_the_balancer_one_by_one(tmp_path):
    """Each event leaves HAProxy as the replica writes it, not held back to go with the next ones."""
    step_s = 0.04
    settings = sim_settings(tmp_path, step_s)  # a token every step, whatever the machine's load
    proc, url = start_cluster(["1", "dynamic"], tmp_path, RUN_DIR=str(tmp_path), **settings)
    try:
        body = {"prompt": "The lighthouse keeper", "max_tokens": 16, "ignore_eos": True, "stream": True}
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as response:
            arrivals = [time.monotonic() for line in response.iter_lines() if line.startswith(b"data: {")]
    finally:
        stop_server(proc)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(gaps) > 8 and statistics.median(gaps) > step_s / 2, gaps


@needs_haproxy
def test_the_benchmark_runs_against_the_cluster(cluster, tmp_path):
    from client.benchmark import main

    argv = ["--url", cluster.url, "--workload", "shared-prefix", "--numsamples", "6", "--mean-tokens", "4"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert run["summary"]["requests_ok"] == 6 and set(run["server_stats"]["replicas"]) == set(cluster.replicas)


class Sent(NamedTuple):
    streamed: bool
    sent: float  # time.monotonic() when it was sent
    done: float  # when its answer ended, or its error came
    ok: bool
    replica: str | None  # X-Replica, as the answer's headers said
    error: str | None


class Load:
    """Clients sending through the balancer, each one request after another until stopped, every other one
    streamed; it knows which streams are open on which replica (their headers name it). Each prompt starts
    with its client and number, so every request has a key of its own: requests of both kinds reach both
    replicas, however the replicas' random ports place them on the hash ring."""

    STREAMED_TOKENS, WHOLE_TOKENS = 100, 40

    def __init__(self, url: str, clients: int):
        self.url, self.results, self.stop = url, [], threading.Event()
        self.lock = threading.Lock()
        self.streams: Counter = Counter()  # open streams by replica; None: no headers yet
        self.pool = ThreadPoolExecutor(clients)
        self.clients = [self.pool.submit(self._client, c) for c in range(clients)]

    def _client(self, c: int) -> None:
        for i in itertools.count():
            if self.stop.is_set():
                return
            self.results.append(self._send(f"{c}.{i} is a question:", streamed=(c + i) % 2 == 0))

    def _send(self, prompt: str, streamed: bool) -> Sent:
        tokens = self.STREAMED_TOKENS if streamed else self.WHOLE_TOKENS
        body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": streamed}
        sent, replica, where = time.monotonic(), None, None
        if streamed:
            self._move(None, +1)
        try:
            with requests.post(f"{self.url}/v1/completions", json=body, stream=streamed, timeout=60) as response:
                replica = response.headers.get("X-Replica")
                if streamed:
                    where = self._move(None, -1, to=replica)
                if response.status_code != 200:
                    return Sent(streamed, sent, time.monotonic(), False, replica, f"HTTP {response.status_code}")
                if streamed:
                    ended = any(line == b"data: [DONE]" for line in response.iter_lines())
                    error = None if ended else "the stream ended without [DONE]"
                else:
                    error = None if response.json()["choices"][0]["text"] else "no text"
        except requests.RequestException as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            if streamed:
                self._move(where, -1)
        return Sent(streamed, sent, time.monotonic(), error is None, replica, error)

    def _move(self, replica: str | None, step: int, to: str | None = None) -> str | None:
        """Count a stream in or out under `replica` (and, with `to`, into `to`); where it is now."""
        with self.lock:
            self.streams[replica] += step
            if to is not None:
                self.streams[to] += 1
        return to if to is not None else replica

    def open_streams(self) -> Counter:
        with self.lock:
            return Counter(self.streams)

    def finish(self, deadline_s: float) -> list[Sent]:
        """Stop sending; every request's record, once each client has its last answer (none may hang)."""
        self.stop.set()
        done, hanging = wait(self.clients, timeout=deadline_s)
        self.pool.shutdown(wait=False)
        assert not hanging, f"{len(hanging)} clients still waiting {deadline_s} s after the load stopped"
        for future in done:
            future.result()
        return list(self.results)


@needs_haproxy
def test_a_replica_killed_under_load(tmp_path):
    """SIGKILL one of two replicas while requests run on both: a stream it was sending breaks at once (an error,
    not a hang); every request it had not started answering, and every request sent after, is answered by the
    other (HAProxy re-sends it); it is taken out, and once restarted it is put back and gets traffic again."""
    settings = {**sim_settings(tmp_path, step_s=0.02), "KV_CACHE_BLOCKS": "2048"}  # 2 s a stream, 0.8 s the rest
    (doomed, doomed_url), (survivor, survivor_url) = start_replicas(tmp_path, settings, settings)
    victim, other = doomed_url.removeprefix("http://"), survivor_url.removeprefix("http://")
    balancer = load = None
    try:
        balancer, url = start_cluster([], tmp_path, REPLICAS_AT=f"{victim},{other}", RUN_DIR=str(tmp_path))
        status = lambda: haproxy_view(tmp_path)[victim]["status"]
        running = lambda: requests.get(f"{doomed_url}/stats", timeout=10).json()["requests_running"]
        load = Load(url, clients=8)

        def both_kinds_on_the_victim() -> bool:  # a stream it is sending, and a request it has not answered yet
            streams = load.open_streams()
            return streams[victim] >= 1 and running() - streams[victim] - streams[None] >= 1

        poll(both_kinds_on_the_victim, 30, "no stream and no other request on the victim at once")
        os.killpg(doomed.pid, signal.SIGKILL)
        doomed.wait()
        killed = time.monotonic()
        poll(lambda: status().startswith("DOWN"), 10, "not taken out")
        down = time.monotonic()
        poll(lambda: sum(r.sent > down for r in load.results) >= 8, 30, "no answers after it was taken out")

        doomed, _ = start_server("dynamic", tmp_path, port=int(victim.rsplit(":", 1)[1]), **settings)
        poll(lambda: status().startswith("UP"), 10, "not put back")
        up = time.monotonic()
        poll(lambda: any(r.sent > up and r.replica == victim for r in load.results), 30, "no traffic once back")
        results = load.finish(deadline_s=30)
    finally:
        if load is not None:
            load.stop.set()
        for proc in (balancer, doomed, survivor):
            if proc is not None and proc.poll() is None:
                stop_server(proc)

    failed = [r for r in results if not r.ok]
    assert failed, "no stream broke: the victim was sending none"
    assert all(r.streamed and r.replica == victim and r.sent < killed for r in failed), failed
    assert all(r.done < killed + 5 for r in failed)  # broken at once, not left hanging
    assert all(r.ok for r in results if not r.streamed)  # those it had not answered were re-sent to the other
    assert all(r.ok for r in results if r.sent > killed)  # zero failures once it was dead: before and after DOWN
    assert sum(r.sent > down for r in results) >= 8


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
    # a grace long enough for 400 tokens on a loaded machine: it bounds the wait, the request ends it
    settings = {**replica_settings(tiny_checkpoint), "SHUTDOWN_GRACE_S": "120"}
    proc, url = start_cluster(["1", "dynamic"], tmp_path, RUN_DIR=str(tmp_path), **settings)
    port = int(url.rsplit(":", 1)[1])
    try:
        with ThreadPoolExecutor(1) as pool:
            body = {"prompt": "Keep going", "num_tokens": 400, "temperature": 0}
            running = pool.submit(requests.post, f"{url}/inference", json=body, timeout=240)
            poll(lambda: requests.get(f"{url}/stats", timeout=10).json()["requests_running"] == 1, 30, "never ran")
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=200)
            assert running.result().status_code == 200  # the replica finished it before going
        for p in (port, port + 1):  # HAProxy and the replica are gone
            with pytest.raises(requests.ConnectionError):
                requests.get(f"http://127.0.0.1:{p}/health", timeout=10)
    finally:
        if proc.poll() is None:
            stop_server(proc)


@needs_haproxy
def test_each_replicas_dashboard_through_the_balancer(cluster):
    index = requests.get(f"{cluster.url}/dashboard", timeout=10)
    assert index.status_code == 200 and index.headers["Content-Type"].startswith("text/html")
    for name in cluster.replicas:
        assert f'href="replica/{name}/dashboard"' in index.text
        page = requests.get(f"{cluster.url}/replica/{name}/dashboard", timeout=10)
        assert page.status_code == 200 and page.headers["X-Replica"] == name
        script = requests.get(f"{cluster.url}/replica/{name}/dashboard/dashboard.js", timeout=10)
        assert script.status_code == 200 and script.headers["X-Replica"] == name
        # the page's data comes from its replica every time, whatever the balancing would pick
        for _ in range(4):
            timeline = requests.get(f"{cluster.url}/replica/{name}/stats/timeline?since=0", timeout=10)
            assert timeline.status_code == 200 and timeline.headers["X-Replica"] == name
            assert "steps" in timeline.json()


def test_the_balancers_stats_pass_the_api_key_on(tiny_checkpoint, tmp_path):
    settings = {**replica_settings(tiny_checkpoint), "API_KEY": "sesame"}
    proc, url = start_cluster(["1", "dynamic"], tmp_path, RUN_DIR=str(tmp_path), **settings)  # /health is open
    try:
        refused = requests.get(f"{url}/stats", timeout=10)
        stats = requests.get(f"{url}/stats", headers={"Authorization": "Bearer sesame"}, timeout=10)
    finally:
        stop_server(proc)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert refused.headers["WWW-Authenticate"] == "Bearer"  # the balancer's /stats says it as a replica does
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


def test_cluster_sh_refuses_an_unknown_balance():
    result = run_cluster_sh("2", "dynamic", BALANCE="leastconn")
    assert result.returncode == 1 and "BALANCE must be prefix or roundrobin" in result.stderr


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
