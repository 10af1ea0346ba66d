"""API_SERVER_COUNT=2: two gunicorn workers, each a front end of the one engine process that gunicorn's master
started. Requests spread over both are each answered once and counted once; an adapter loaded through one is
served by both; a front end killed mid-stream has its requests cancelled while the engine serves on; SIGTERM lets
running requests finish; a bad combination of settings is one line. (Admission across both, and a killed engine:
tests/test_engine_process.py; the Batch API: tests/test_batches_multi.py.)"""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from client.launch import running_server
from tests.conftest import sim_settings, wait_until
from tests.test_engine_process import (
    _stream,
    alive,
    ok,
    server_processes,
    serving,
    started_processes,
    streams_under_way,
)
from tests.test_server import TOKENIZER, greedy_all, text_prompts

ROOT = Path(__file__).resolve().parent.parent
TWO = {"ENGINE_PROCESS": "on", "API_SERVER_COUNT": "2"}


def test_requests_over_both_front_ends_are_answered_and_counted_once(tiny_checkpoint, hf_greedy, tmp_path):
    with serving(tmp_path, MODEL=str(tiny_checkpoint), KV_CACHE_BLOCKS="1024", **TWO) as (url, master):
        started_processes(master, 2)  # both front ends up
        prompts, counts = text_prompts(24, seed=11), [3 + i % 5 for i in range(24)]
        answers, rounds, deadline = [], 0, time.monotonic() + 60
        # 12 connections at a time, each taken by whichever front end accepts first: on a loaded machine one may
        # take a whole round, so rounds go on until both have answered some
        while True:
            answers += greedy_all(url, prompts, counts, workers=12)
            rounds += 1
            stats = requests.get(f"{url}/stats", timeout=10).json()
            spread = stats["front_end_requests"]
            if len(spread) == 2 and min(spread) > 0 or time.monotonic() > deadline:
                break
        metrics = requests.get(f"{url}/metrics", timeout=10).text
    for prompt, count, answer in zip(prompts * rounds, counts * rounds, answers, strict=True):
        assert answer["token_ids"] == hf_greedy(TOKENIZER.encode(prompt), count)
    counted = (stats["requests_completed"], stats["tokens_generated"], stats["requests_failed"])
    assert counted == (24 * rounds, sum(counts) * rounds, 0)
    assert len(spread) == 2 and sum(spread) == 24 * rounds and min(spread) > 0, spread
    assert 'vllm:request_success_total{finished_reason="length",model_name=' in metrics
    (line,) = [x for x in metrics.splitlines() if x.startswith('vllm:request_success_total{finished_reason="length"')]
    assert float(line.rsplit(" ", 1)[1]) == 24 * rounds


def test_an_adapter_loaded_through_one_front_end_is_served_by_both(tiny_checkpoint, lora_adapters, tmp_path):
    settings = {
        "MODEL": str(tiny_checkpoint),
        "ALLOW_RUNTIME_LORA_UPDATING": "true",
        "LORA_ROOT": str(lora_adapters["alpha"].parent),
        **TWO,
    }
    with running_server("dynamic", tmp_path, **settings) as url:
        body = {"lora_name": "beta", "lora_path": str(lora_adapters["beta"])}
        assert requests.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60).status_code == 200
        completion = {"model": "beta", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        deadline = time.monotonic() + 60
        while True:  # eight at once, each taken by whichever front end accepts first: rounds until both had some
            with ThreadPoolExecutor(8) as pool:
                models = list(pool.map(lambda _: requests.get(f"{url}/v1/models", timeout=10).json(), range(16)))
                codes = list(pool.map(lambda _: post(url, completion), range(16)))
            assert all("beta" in {card["id"] for card in listing["data"]} for listing in models)
            assert codes == [200] * 16
            spread = requests.get(f"{url}/stats", timeout=10).json()["front_end_requests"]
            if len(spread) == 2 and min(spread) > 0 or time.monotonic() > deadline:
                break
        assert len(spread) == 2 and min(spread) > 0, spread
        assert requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "beta"}, timeout=60).ok
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: post(url, completion), range(16)))
        assert codes == [404] * 16


def post(url: str, body: dict) -> int:
    return requests.post(f"{url}/v1/completions", json=body, timeout=60).status_code


def sockets(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:  # closed while we look
            continue
    return count


def test_a_killed_front_end_has_its_requests_cancelled_and_the_engine_serves_on(tmp_path):
    settings = {**sim_settings(tmp_path, step_s=0.05), **TWO}
    with serving(tmp_path, **settings) as (url, master):
        workers, engine = started_processes(master, 2)
        before = {pid: sockets(pid) for pid in workers}
        with ThreadPoolExecutor(16) as pool:
            streams = streams_under_way(pool, url, 16, 100)  # 5 s each, unless cancelled
            # the front end holding the most of their connections
            victim = max(workers, key=lambda pid: sockets(pid) - before[pid])
            os.kill(victim, signal.SIGKILL)
            # its streams break off; the engine cancels their requests at once, the others run on
            cut = sum(1 for stream in streams if stream.exception(timeout=60) is not None)
            stats = lambda: requests.get(f"{url}/stats", timeout=10).json()  # noqa: E731
            wait_until(lambda: stats()["finish_reasons"]["abort"] == cut, deadline_s=5)
        assert cut >= 8
        assert stats()["finish_reasons"]["length"] == 16 - cut and alive(engine)
        # gunicorn's new worker says Hello to the same engine and serves
        wait_until(lambda: len(server_processes(master)[0]) == 2 and all(ok(url) for _ in range(8)))
        assert server_processes(master)[1] == engine
        events, _ = _stream(url, 5)
        assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_sigterm_lets_running_requests_finish_then_nothing_is_left(tmp_path):
    settings = {**sim_settings(tmp_path, step_s=0.02), **TWO, "SHUTDOWN_GRACE_S": "10"}
    with serving(tmp_path, **settings) as (url, master):
        workers, engine = started_processes(master, 2)
        with ThreadPoolExecutor(8) as pool:
            streams = streams_under_way(pool, url, 8, 60)
            os.kill(master, signal.SIGTERM)
            results = [stream.result(timeout=30) for stream in streams]
        for events, _ in results:
            assert events[-1].get("choices", [{}])[0].get("finish_reason") == "length", events[-1]
        wait_until(lambda: not any(alive(pid) for pid in (*workers, engine)), deadline_s=15)


def test_two_front_ends_without_the_engine_process_is_one_clear_line(tmp_path):
    env = {**os.environ, "ENGINE_PROCESS": "off", "API_SERVER_COUNT": "2", "PORT": "1"}
    done = subprocess.run([sys.executable, "-m", "deploy.env"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "API_SERVER_COUNT above 1 needs ENGINE_PROCESS=on" in done.stderr and "Traceback" not in done.stderr
