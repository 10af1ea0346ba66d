"""The batching loop under faults, in process: queue limits, timeouts, and a loop that dies."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import wait_until


def post(app, body):
    return app.test_client().post("/inference", json=body)


def test_full_queue_gets_503_and_a_dead_loop_fails_everyone_at_once(make_app):
    app, manager = make_app(max_waiting=2)
    gate = threading.Event()

    def broken_step():
        gate.wait()
        raise RuntimeError("simulated failure")

    manager.engine.step = broken_step
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(post, app, {"prompt": f"request {i}", "num_tokens": 5}) for i in range(2)]
        wait_until(lambda: manager.num_waiting() == 2)
        full = post(app, {"prompt": "one too many", "num_tokens": 5})
        assert full.status_code == 503 and full.headers["Retry-After"] == "1"
        gate.set()
        answers = [f.result(timeout=30) for f in waiting]
    assert [a.status_code for a in answers] == [500, 500]
    assert all("simulated failure" in a.get_json()["error"]["message"] for a in answers)
    client = app.test_client()
    assert client.get("/health").status_code == 503
    assert post(app, {"prompt": "after", "num_tokens": 1}).status_code == 503
    assert client.get("/stats").get_json()["requests_failed"] == 2


def test_request_over_its_timeout_is_aborted_with_504_and_frees_its_blocks(make_app):
    app, manager = make_app(request_timeout_s=0.2)
    engine, gate = manager.engine, threading.Event()
    step, cancel = engine.step, manager.cancel

    def held_step():
        gate.wait()  # hold the loop until the request has given up
        return step()

    def cancel_then_release(inf):
        cancel(inf)
        gate.set()

    engine.step, manager.cancel = held_step, cancel_then_release
    answer = post(app, {"prompt": "slow", "num_tokens": 500})
    assert answer.status_code == 504 and "error" in answer.get_json()
    wait_until(lambda: not engine.has_work())
    engine.blocks.check_integrity([])
    assert engine.blocks.num_used_blocks == 0
    assert app.test_client().get("/health").status_code == 200
    assert post(app, {"prompt": "next", "num_tokens": 3}).status_code == 200


def test_request_that_could_never_fit_the_pool_is_refused_at_once(make_app):
    app, manager = make_app(kv_cache_blocks=4, block_size=16)  # 64 tokens in all
    refused = post(app, {"prompt": "a b c d", "num_tokens": 61})
    assert refused.status_code == 400 and "whole KV cache (64 tokens)" in refused.get_json()["error"]["message"]
    assert post(app, {"prompt": "a b c d", "num_tokens": 60}).status_code == 200
    assert not manager.engine.has_work()


def test_a_stop_string_ends_the_sequence_in_the_engine_without_a_call_back_down(make_app):
    app, manager = make_app()

    def no_abort(seq):
        raise AssertionError("a sequence that finished normally was aborted from above")

    manager.engine.abort = no_abort
    client = app.test_client()
    body = {"prompt": "The lighthouse", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=body).get_json()["choices"][0]["text"]
    stop = full[10:13]
    cut = client.post("/v1/completions", json={**body, "stop": stop}).get_json()["choices"][0]
    assert cut["text"] == full[: full.index(stop)] and cut["finish_reason"] == "stop"
    wait_until(lambda: not manager.engine.has_work())
    manager.engine.blocks.check_integrity([])


@pytest.mark.parametrize("mode", ["nobatch", "static", "dynamic"])
def test_n_and_lists_of_prompts_in_every_mode(make_app, hf_greedy, mode):
    app, manager = make_app(mode=mode, max_batch_size=4)
    tokenizer = app.extensions["server"].tokenizer
    prompts = ["The keeper", "Ships in the night pass", "A lamp"]
    body = {"prompt": prompts, "n": 3, "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:  # and other requests at the same time
        answers = list(pool.map(lambda _: app.test_client().post("/v1/completions", json=body), range(3)))
    expected = [tokenizer.decode(hf_greedy(tokenizer.encode(p), 7)) for p in prompts for _ in range(3)]
    for answer in answers:
        assert answer.status_code == 200, answer.get_json()
        assert [c["text"] for c in answer.get_json()["choices"]] == expected
    wait_until(lambda: not manager.engine.has_work())
    manager.engine.blocks.check_integrity([])
    assert manager.stats.snapshot()["requests_completed"] == 27


def test_the_engine_is_built_and_stepped_on_the_loop_thread(make_app, monkeypatch):
    """Every torch op of the engine runs on one thread: on a CPU, another thread's parallel regions would
    start a second OpenMP team and slow every step (batching/manager.py)."""
    from generate.engine import Engine

    threads, build = {}, Engine.from_settings

    def recording_build(cls, settings):
        threads["built"] = threading.current_thread()
        return build(settings)

    monkeypatch.setattr(Engine, "from_settings", classmethod(recording_build))
    app, manager = make_app()
    step = manager.engine.step

    def recording_step():
        threads.setdefault("stepped", threading.current_thread())
        return step()

    manager.engine.step = recording_step
    assert post(app, {"prompt": "one thread", "num_tokens": 2}).status_code == 200
    assert threads["built"] is threads["stepped"] is not threading.current_thread()


def test_the_cache_is_verified_once_the_loop_has_idled_a_while_and_a_fault_shows_in_stats(make_app):
    """The integrity check waits IDLE_CHECK_S of idleness: at once, a large pool's check delayed the request
    that ended a short idle spell."""
    from batching.manager import IDLE_CHECK_S

    app, manager = make_app()
    blocks, checks, broken = manager.engine.blocks, [], threading.Event()
    verify = blocks.check_integrity

    def recording_check(live):
        checks.append(time.monotonic())
        verify(live)
        if broken.is_set():
            raise AssertionError("refcounts differ from the block tables")

    blocks.check_integrity = recording_check
    assert post(app, {"prompt": "first", "num_tokens": 2}).status_code == 200
    answered_at = time.monotonic()
    wait_until(lambda: checks and checks[-1] > answered_at, deadline_s=10)  # the loop idles after it, checks, waits
    broken.set()
    sent_at = time.monotonic()
    assert post(app, {"prompt": "second", "num_tokens": 2}).status_code == 200
    stats = lambda: app.test_client().get("/stats").get_json()  # noqa: E731
    wait_until(lambda: stats()["kv_cache_integrity"] != "ok", deadline_s=10)
    assert stats()["kv_cache_integrity"] == "refcounts differ from the block tables"
    assert checks[-1] >= sent_at + IDLE_CHECK_S  # the loop idled after this request, then waited before checking
