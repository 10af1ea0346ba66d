"""ENGINE_PROCESS=on: the engine in a process of its own, behind real gunicorn servers.

The same answers as one process (every answer, streamed or not, equal to the in-process server's on the same
requests; greedy against transformers in every mode is tests/test_server.py's, in both layouts), counted once,
and the engine's failures: killed, it answers every stream with an error at once and comes back by itself; it
never outlives its front end."""

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import requests

from batching import channel, engine_client, wire
from client.launch import running_server, start_server, stop_server
from config import Settings
from tests.conftest import sim_settings, wait_until
from tests.test_server import greedy_all, text_prompts


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Running and not a zombie; a process reaped while we look is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone, or going while we read
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@contextlib.contextmanager
def serving(tmp_path: Path, **settings: str) -> Iterator[tuple[str, int]]:
    """./server.sh dynamic: its URL and its gunicorn master's process id."""
    proc, url = start_server("dynamic", tmp_path, **settings)
    try:
        yield url, proc.pid  # server.sh execs gunicorn
    finally:
        stop_server(proc)


def server_processes(master: int) -> tuple[list[int], int]:
    """The gunicorn workers under `master`, and the engine's process: the one worker's child (API_SERVER_COUNT=1)
    or the master's (more); beside it, multiprocessing's resource tracker."""

    def command(pid: int) -> bytes:
        return Path(f"/proc/{pid}/cmdline").read_bytes()

    workers = [pid for pid in children(master) if b"gunicorn" in command(pid)]
    (engine,) = [pid for parent in (master, *workers) for pid in children(parent) if b"spawn_main" in command(pid)]
    return workers, engine


def started_processes(master: int, front_ends: int) -> tuple[list[int], int]:
    """server_processes once all `front_ends` workers are there: a server is healthy as soon as one answers, and
    gunicorn forks the others up to 0.1 s apart."""
    wait_until(lambda: len(server_processes(master)[0]) == front_ends)
    return server_processes(master)


@pytest.fixture(scope="module")
def settings(tiny_checkpoint) -> dict[str, str]:
    return {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "1024", "ENGINE_PROCESS": "on"}


# Requests whose every answer is fixed by its body (greedy, or seeded): the same bytes from either layout but for
# ids and clocks. Streamed and not, n > 1, log-probabilities, echo, stop strings, a constraint, chat.
BODIES = [
    ("/v1/completions", {"prompt": "The old lighthouse", "max_tokens": 12, "temperature": 0, "logprobs": 2}),
    ("/v1/completions", {"prompt": "Once upon", "max_tokens": 9, "temperature": 0, "echo": True, "logprobs": 1}),
    ("/v1/completions", {"prompt": "A recipe", "max_tokens": 16, "temperature": 0.9, "seed": 7, "n": 3}),
    ("/v1/completions", {"prompt": "It was", "max_tokens": 20, "temperature": 0, "stop": [" the", "e"]}),
    ("/v1/completions", {"prompt": ["one", "two"], "max_tokens": 6, "temperature": 0.8, "seed": 3, "stream": True}),
    (
        "/v1/completions",
        {"prompt": "Lists", "max_tokens": 10, "temperature": 0, "n": 2, "stream": True, "logprobs": 1},
    ),
    ("/v1/completions", {"prompt": "Pick", "max_tokens": 8, "temperature": 0, "guided_choice": ["red", "blue"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7, "temperature": 0}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hey"}],
            "max_tokens": 5,
            "seed": 1,
            "stream": True,
            "logprobs": True,
        },
    ),
    ("/inference", {"prompt": "The lighthouse keeper", "num_tokens": 6, "temperature": 0}),
]
VARYING = ("id", "created", "ttft_s", "latency_s", "system_fingerprint")


def _answer(url: str, path: str, body: dict) -> list:
    response = requests.post(f"{url}{path}", json=body, timeout=60, stream=body.get("stream", False))
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        return [_steady(response.json())]
    lines = [line for line in response.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    return [_steady(json.loads(line.removeprefix("data: "))) for line in lines[:-1]]


def _steady(value):
    if isinstance(value, dict):
        return {key: _steady(item) for key, item in value.items() if key not in VARYING}
    return [_steady(item) for item in value] if isinstance(value, list) else value


def test_every_answer_equals_the_in_process_servers(settings, tmp_path):
    answers = {}
    for layout in ("off", "on"):
        (tmp_path / layout).mkdir()
        with running_server("dynamic", tmp_path / layout, **{**settings, "ENGINE_PROCESS": layout}) as url:
            answers[layout] = [_answer(url, path, body) for path, body in BODIES]
    for (path, body), off, on in zip(BODIES, answers["off"], answers["on"]):
        assert on == off, f"{path} {body}"


def test_requests_are_counted_once_and_a_bad_body_is_the_front_ends_400(settings, tmp_path):
    with running_server("dynamic", tmp_path, **settings) as url:
        bad = requests.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        counts = [4, 9, 1, 6]
        greedy_all(url, text_prompts(4, seed=5), counts, workers=4)
        stats = requests.get(f"{url}/stats", timeout=10).json()
        metrics = requests.get(f"{url}/metrics", timeout=10).text
        health = requests.get(f"{url}/health", timeout=10).json()
    assert (stats["requests_completed"], stats["tokens_generated"], stats["requests_failed"]) == (4, sum(counts), 0)
    assert 'vllm:request_success_total{finished_reason="length",model_name=' in metrics
    assert (health["status"], health["engine_restarts"]) == ("ok", 0)


def _stream(url: str, max_tokens: int, started: threading.Event | None = None) -> tuple[list[dict], float]:
    """A streamed completion's events, and when the stream ended (monotonic); `started` set at its first event."""
    body = {"prompt": "The lighthouse keeper", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    events = []
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as response:
        for line in response.iter_lines(decode_unicode=True):
            if line and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
                if started is not None:
                    started.set()
    return events, time.monotonic()


def streams_under_way(pool: ThreadPoolExecutor, url: str, count: int, max_tokens: int) -> list:
    """`count` streams started, each past its first event: their futures."""
    started = [threading.Event() for _ in range(count)]
    streams = [pool.submit(_stream, url, max_tokens, event) for event in started]
    wait_until(lambda: all(event.is_set() for event in started))
    return streams


@pytest.mark.parametrize("front_ends", ["1", "2"])
def test_a_killed_engine_answers_every_stream_with_an_error_and_comes_back(tmp_path, front_ends):
    settings = {**sim_settings(tmp_path, step_s=0.05), "ENGINE_PROCESS": "on", "API_SERVER_COUNT": front_ends}
    with serving(tmp_path, **settings) as (url, master):
        workers, engine = started_processes(master, int(front_ends))
        with ThreadPoolExecutor(32) as pool:
            streams = streams_under_way(pool, url, 32, 400)
            os.kill(engine, signal.SIGKILL)
            killed = time.monotonic()
            wait_until(lambda: requests.get(f"{url}/health", timeout=10).status_code == 503, deadline_s=1)
            results = [stream.result(timeout=30) for stream in streams]
        for events, ended in results:
            assert ended - killed < 2
            assert "error" in events[-1] and "engine process exited" in events[-1]["error"]["message"]
            assert any(event.get("choices") for event in events)  # it had streamed tokens before
        wait_until(lambda: all(ok(url) for _ in range(8)), deadline_s=60)  # whichever front end answers
        assert requests.get(f"{url}/health", timeout=10).json()["engine_restarts"] == 1
        assert server_processes(master)[0] == workers  # the same front ends, a new engine
        events, _ = _stream(url, 5)
        assert events[-1]["choices"][0]["finish_reason"] == "length"


def ok(url: str) -> bool:
    return requests.get(f"{url}/health", timeout=10).status_code == 200


def test_a_killed_worker_leaves_no_engine_behind(settings, tmp_path):
    with serving(tmp_path, **settings) as (url, master):
        (worker,), engine = server_processes(master)
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: not alive(engine), deadline_s=5)


def test_sigterm_lets_running_requests_finish(tmp_path):
    settings = {**sim_settings(tmp_path, step_s=0.02), "ENGINE_PROCESS": "on", "SHUTDOWN_GRACE_S": "10"}
    with serving(tmp_path, **settings) as (url, master):
        (worker,), engine = server_processes(master)
        with ThreadPoolExecutor(8) as pool:
            streams = streams_under_way(pool, url, 8, 60)
            os.kill(worker, signal.SIGTERM)
            results = [stream.result(timeout=30) for stream in streams]
        for events, _ in results:
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        wait_until(lambda: not alive(engine), deadline_s=10)


@pytest.mark.parametrize("front_ends", ["1", "2"])
def test_a_refusal_comes_from_the_engines_admission(tmp_path, front_ends):
    """MAX_WAITING=2 with one running: of 8 requests at once, at most 3 are admitted, whichever front end each
    reached (two front ends admitting on counts of their own would let up to 6 in)."""
    slow = {**sim_settings(tmp_path, step_s=0.05), "ENGINE_PROCESS": "on", "MAX_WAITING": "2", "MAX_BATCH_SIZE": "1"}
    slow["API_SERVER_COUNT"] = front_ends
    with running_server("dynamic", tmp_path, **slow) as url:
        body = {"prompt": "x", "max_tokens": 40, "temperature": 0}
        codes: list[int] = []
        lock = threading.Lock()

        def one() -> None:
            code = requests.post(f"{url}/v1/completions", json=body, timeout=60).status_code
            with lock:
                codes.append(code)

        with ThreadPoolExecutor(8) as pool:
            for _ in range(8):
                pool.submit(one)
        stats = requests.get(f"{url}/stats", timeout=10).json()
    assert set(codes) <= {200, 503} and 1 <= codes.count(200) <= 3, codes
    assert stats["requests_completed"] == codes.count(200) and sum(stats["front_end_requests"]) == 8


@contextlib.contextmanager
def engine_core(tmp_path: Path) -> Iterator:
    """The engine process's EngineCore and loop in this process, over the simulated engine (1 ms steps); after the
    block, everything it would have sent front end 7 (no front end connects)."""
    import functools

    from batching.engine_process import EngineCore
    from batching.manager import BatchingManager
    from config import Settings
    from sim.engine import simulated_engine

    settings = Settings.of(**{k.lower(): v for k, v in sim_settings(tmp_path, step_s=0.001).items()})
    core = EngineCore(restarts=0)
    manager = BatchingManager(
        functools.partial(simulated_engine, settings.engine, announce=False), settings, core.flush, core.push
    )
    core.attach(manager)
    manager.start()
    queued: list = []
    try:
        yield core, queued
    finally:
        manager.shut_down(0)
        manager.join()
    while not core.outgoing.empty():
        queued += [message for client, message in core.outgoing.get_nowait() if client == 7]


def sent_tokens(queued: list, rid: int) -> list[int]:
    from batching import wire

    return [i for m in queued if isinstance(m, wire.Tokens) for r, i in zip(m.rids, m.ids) if r == rid]


def test_a_request_the_engine_cannot_take_is_refused_alone(tmp_path):
    """In the engine's process, a request whose constraint fails to compile there (the front end compiled it,
    then the engine's own compile failed: a timeout, say) is answered 400 and the next request still runs."""
    from batching import wire

    params = wire.Params(4, 0.0, 0, 1.0, None, False, None, None, 0, 0.0, 0.0, 1.0, [], None)
    bad = wire.Params(**{**{f: getattr(params, f) for f in params.__struct_fields__}, "constraint": ("nope", "", None)})
    with engine_core(tmp_path) as (core, queued):
        refused = core._submit_or_refuse(
            wire.Submit(7, 1, [wire.Completion([1, 2], bad, False, False)], [], 0, "", None, True)
        )
        assert refused.refusal is not None and refused.refusal[1] == 400 and "nope" in refused.refusal[2]
        accepted = core._submit_or_refuse(
            wire.Submit(7, 2, [wire.Completion([1, 2], params, False, False)], [], 0, "", None, True)
        )
        assert accepted.refusal is None
        wait_until(lambda: (7, 2) not in core.requests)  # answered: its end went out
    (end,) = [m for m in queued if isinstance(m, wire.Ended)]
    assert (end.rid, end.finish_reason, len(sent_tokens(queued, 2))) == (2, "length", 4)


def test_a_steps_tokens_go_out_as_the_next_step_begins_its_forward_pass(tmp_path):
    """The engine's process sends each step's tokens once the next step's inputs are built, not at the step's end
    (the threads a send wakes would take the loop's core while it schedules and builds), and the last step's as
    the loop goes idle: each step's tokens in a message of their own."""
    from batching import wire

    params = wire.Params(4, 0.0, 0, 1.0, None, False, None, None, 0, 0.0, 0.0, 1.0, [], None)
    with engine_core(tmp_path) as (core, queued):
        engine, schedule, push, pushes, seen = core.engine, core.engine.scheduler.schedule, core.push, [], []

        def sent(moment: str) -> None:
            while not core.outgoing.empty():
                pushes.append([message for client, message in core.outgoing.get_nowait() if client == 7])
            seen.append((moment, engine.num_steps, len(sent_tokens(sum(pushes, []), 1))))

        def scheduling() -> list:
            sent("schedule")  # the step before is done: engine.num_steps of them
            return schedule()

        def before_forward() -> None:
            push()
            sent("forward")

        engine.scheduler.schedule, engine.before_forward = scheduling, before_forward
        submit = wire.Submit(7, 1, [wire.Completion([1, 2], params, False, False)], [], 0, "", None, True)
        assert core._submit_or_refuse(submit).refusal is None
        wait_until(lambda: (7, 1) not in core.requests)
    pushes.append(queued)  # the last step's, sent as the loop went idle
    # step k: while it schedules, the tokens of the k - 2 before the last are out; at its forward pass, all k - 1
    expected = [[("schedule", k - 1, max(k - 2, 0)), ("forward", k, k - 1)] for k in range(1, 5)]
    assert seen[:8] == sum(expected, [])  # (the loop's shutdown may schedule once more, with nothing to run)
    assert [len(sent_tokens(batch, 1)) for batch in pushes if batch] == [1, 1, 1, 1]


def test_a_completion_not_streamed_has_its_first_token_sent_with_its_step_and_the_rest_with_its_end(tmp_path):
    """Not streamed, a completion's tokens after its first go in its Ended, with their log-probabilities, not one
    per step: the same tokens as the same request streamed, whose Ended carries none."""
    from batching import wire

    params = wire.Params(6, 0.0, 0, 1.0, None, False, 1, None, 0, 0.0, 0.0, 1.0, [], None)
    with engine_core(tmp_path) as (core, queued):
        for rid, streamed in ((1, True), (2, False)):
            submit = wire.Submit(7, rid, [wire.Completion([5, 6, 7], params, False, False)], [], 0, "", None, streamed)
            assert core._submit_or_refuse(submit).refusal is None
        wait_until(lambda: not core.requests)
    ends = {m.rid: m for m in queued if isinstance(m, wire.Ended)}
    streamed, whole = sent_tokens(queued, 1), sent_tokens(queued, 2)
    assert len(streamed) == 6 and ends[1].ids == [] and ends[1].logprobs == []
    assert len(whole) == 1 and whole + ends[2].ids == streamed
    rows = [(m.rids[row], entries) for m in queued if isinstance(m, wire.Tokens) for row, entries in m.logprobs]
    per_step = {rid: [entry for r, entries in rows if r == rid for entry in entries] for rid in (1, 2)}
    assert len(per_step[1]) == 6 and per_step[2] + ends[2].logprobs == per_step[1]


def test_a_call_made_while_the_front_end_reconnects_is_answered(tmp_path, monkeypatch):
    """A request thread may call the engine (a /metrics scrape) once its Hello is sent, before its Ready has been
    read: the engine's Reply can then come in the same read as Ready, and must be played out, not dropped."""
    monkeypatch.setattr(engine_client, "CALL_TIMEOUT_S", 3.0)  # where the Reply is dropped, the call fails by then
    encode = msgspec.msgpack.encode
    ready = wire.Ready(os.getpid(), 0, "fake", True, 1024, 1024, [])
    listener = channel.listen(str(tmp_path / "in"))  # an engine speaking the wire, one step at a time
    listener.settimeout(30)

    def hello() -> channel.Channel:
        end = channel.Channel(listener.accept()[0])
        assert isinstance(wire_message(end), wire.Hello)
        return end

    def wire_message(end: channel.Channel):
        (payload,) = end.receive(30)
        return msgspec.msgpack.decode(payload, type=wire.ToEngine)

    engine = ThreadPoolExecutor(1)
    first = engine.submit(hello)
    first.add_done_callback(lambda said: said.result().send(encode([ready])))
    client = engine_client.EngineClient(Settings.of(), None, {}, str(tmp_path))  # returns on Ready
    second = engine.submit(hello)
    first.result().close()  # that engine dies; the bridge connects to the next and says Hello
    second = second.result(timeout=30)
    wait_until(lambda: client._channel is not None)  # the bridge's Hello is out: request threads may send
    answer = ThreadPoolExecutor(1).submit(client.call, "stats")
    call = wire_message(second)
    frames = [encode([message]) for message in (ready, wire.Reply(call.cid, {"served": 1}))]
    second.sock.sendall(b"".join(channel.HEADER.pack(len(frame)) + frame for frame in frames))  # one read's worth
    assert answer.result(timeout=30) == {"served": 1}
    wait_until(lambda: client.ready)
    client.shut_down(0)
    second.close()
    listener.close()
