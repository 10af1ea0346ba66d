"""The record behind the dashboard: request events and step records, GET /stats/timeline and its
paging, the step figures in /stats and /metrics, and who may read them. In process (Flask test client)."""

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batching.telemetry.events import PHASE_AFTER, EventLog
from batching.telemetry.live import LIVE_VALUES
from batching.telemetry.step_summary import summarize
from batching.telemetry.window import MAX_SAMPLES, StepTokens, Window
from generate.step_log import STAGES, StepRecord
from model.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer()
# What may follow what in one request's events; an ending may follow anything.
NEXT = {"arrived": {"admitted"}, "admitted": {"prefill"}, "prefill": {"decoding", "preempted"}}
NEXT |= {"decoding": {"preempted", "finished"}, "preempted": {"prefill"}}


def step(index: int, started_at: float = 0.0, **fields) -> StepRecord:
    values = dict(num_decodes=0, num_prefills=0, num_prefill_tokens=0, num_sampled=0, num_running=0, num_waiting=0)
    values |= dict(kv_blocks_used=0, kv_blocks_cached=0, kv_blocks_free=0, preemptions=0)
    return StepRecord(index, started_at, **(values | fields))


def post(app, prompt: str, num_tokens: int, **extra):
    body = {"prompt": prompt, "num_tokens": num_tokens, "temperature": 0, **extra}
    return app.test_client().post("/inference", json=body)


def post_all(app, prompts: list[str], counts: list[int]) -> list[dict]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda pc: post(app, *pc), zip(prompts, counts)))
    assert [a.status_code for a in answers] == [200] * len(answers)
    return [a.get_json() for a in answers]


def timeline(app, since: int = 0, events_since: int = 0, **headers) -> dict:
    answer = app.test_client().get(f"/stats/timeline?since={since}&events_since={events_since}", headers=headers)
    assert answer.status_code == 200, answer.get_data(as_text=True)
    return answer.get_json()


def by_request(events: list[dict]) -> dict[int, list[dict]]:
    requests: dict[int, list[dict]] = {}
    for e in events:
        requests.setdefault(e["request"], []).append(e)
    return requests


def assert_valid_life(events: list[dict]) -> None:
    """One request's events: in the order they happened, each a step its phase allows."""
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "arrived" and PHASE_AFTER[kinds[-1]] is None, kinds
    for before, after in zip(kinds, kinds[1:]):
        assert after in NEXT.get(before, set()) or PHASE_AFTER[after] is None, kinds
    assert [e["at"] for e in events] == sorted(e["at"] for e in events)


# --- the rings, the window figures and the step summary, on hand-made records ----------------------
def test_event_log_keeps_the_last_events_with_consecutive_indices():
    log = EventLog(size=3)
    for request in range(5):
        log.record(request, "arrived", prompt_tokens=4, generated_tokens=0)
    assert [e.index for e in log.since(0)] == [3, 4, 5]
    assert [e.request for e in log.since(0)] == [2, 3, 4]
    assert [e.index for e in log.since(4)] == [5] and log.since(5) == [] and log.count == 5


def test_event_log_indices_stay_consecutive_under_concurrent_recording():
    log = EventLog(size=10_000)

    def record(request: int) -> None:
        for _ in range(500):
            log.record(request, "arrived", 1, 0)

    threads = [threading.Thread(target=record, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [e.index for e in log.since(0)] == list(range(1, 4001))


def test_step_summary_of_hand_made_steps():
    records = [
        step(1, num_prefills=1, duration_s=0.01, stages={"schedule": 0.001, "forward": 0.006}),
        step(2, duration_s=0.02, stages={"schedule": 0.003, "forward": 0.012}),
        step(3, num_prefills=2, duration_s=0.03, stages={"schedule": 0.002, "forward": 0.024, "deliver": 0.003}),
        step(4, duration_s=0.04, stages={"schedule": 0.002, "forward": 0.030}),
    ]
    summary = summarize(records)
    assert (summary.steps, summary.steps_with_prefill) == (4, 2)
    assert summary.step_time_s["mean"] == pytest.approx(0.025)
    assert summary.step_time_s["p50"] == pytest.approx(0.025)
    assert summary.step_time_s["p99"] == pytest.approx(0.0397)  # 0.03 + 0.97 * (0.04 - 0.03)
    assert summary.stage_time_s["schedule"] == pytest.approx(0.002)
    assert summary.stage_time_s["forward"] == pytest.approx(0.018)
    assert summary.stage_time_s["deliver"] == pytest.approx(0.00075)
    assert summary.stage_time_s["build"] == 0.0
    assert summarize([]).step_time_s == {"mean": None, "p50": None, "p99": None}


def test_window_counts_tokens_when_they_come_not_when_requests_end():
    window = Window(seconds=10.0, started_at=0.0)
    window.add_step(StepTokens(at=89.0, tokens=50, ttfts=(9.0,), gaps=((1, 9.0),)))  # before the window
    window.add_step(StepTokens(at=95.0, tokens=3, ttfts=(0.5, 1.5), gaps=((1, 0.2),)))
    window.add_step(StepTokens(at=97.0, tokens=3, ttfts=(), gaps=((1, 0.4), (2, 0.1), (3, 0.3))))
    window.add_step(StepTokens(at=99.0, tokens=1, ttfts=(1.0,), gaps=()))
    window.add_ending(96.0, "finished")
    window.add_ending(98.0, "cancelled")
    figures = window.figures(now=100.0)
    # 7 tokens in the 10 s from 90 to 100, though no request in the window has finished yet
    assert figures["tokens_generated"] == 7 and figures["output_tokens_per_s"] == pytest.approx(0.7)
    assert figures["first_tokens"] == 3 and figures["ttft_s"]["p50"] == 1.0
    assert figures["itl_s"]["mean"] == pytest.approx((0.2 + 0.4 + 0.1 + 0.3) / 4)
    # per request: 1 -> mean(0.2, 0.4) = 0.3, 2 -> 0.1, 3 -> 0.3
    assert figures["tpot_s"]["p50"] == pytest.approx(0.3) and figures["tpot_s"]["mean"] == pytest.approx(0.7 / 3)
    assert (figures["requests_finished"], figures["requests_cancelled"], figures["requests_failed"]) == (1, 1, 0)
    # a server younger than the window: the rate is over its life
    young = Window(seconds=30.0, started_at=98.0)
    young.add_step(StepTokens(at=99.0, tokens=4, ttfts=(), gaps=()))
    assert young.figures(now=100.0)["output_tokens_per_s"] == pytest.approx(2.0)
    assert Window(10.0, 0.0).figures(100.0)["ttft_s"] == {"mean": None, "p50": None, "p99": None}


def test_window_latencies_are_over_its_latest_gaps_only():
    window = Window(seconds=60.0, started_at=0.0)
    for step in range(MAX_SAMPLES // 100):  # MAX_SAMPLES gaps of 1 s, 100 a step
        window.add_step(StepTokens(at=10.0 + step * 1e-3, tokens=100, ttfts=(), gaps=((step, 1.0),) * 100))
    for step in range(MAX_SAMPLES // 100):  # then 50 fewer of 3 s, the last step's cut to 50
        gaps = ((step, 3.0),) * (100 if step < MAX_SAMPLES // 100 - 1 else 50)
        window.add_step(StepTokens(at=30.0 + step * 1e-3, tokens=len(gaps), ttfts=(), gaps=gaps))
    figures = window.figures(now=50.0)
    assert figures["tokens_generated"] == 2 * MAX_SAMPLES - 50  # tokens are counted, not sampled
    # the latest MAX_SAMPLES gaps: all MAX_SAMPLES - 50 of 3 s and the last 50 of 1 s
    assert figures["itl_s"]["mean"] == pytest.approx((3.0 * (MAX_SAMPLES - 50) + 50) / MAX_SAMPLES)


# --- through the app ---------------------------------------------------------------------------------
def test_each_request_has_its_events_in_order_and_each_step_one_record(make_app):
    # An 8-token budget splits the longer prompts into chunks over several steps.
    app, _ = make_app(max_batch_tokens=8)
    prompts = ["The lighthouse keeper", "ships " * 30, "gulls over grey water " * 5, "night"]
    counts = [6, 3, 9, 1]
    answers = post_all(app, prompts, counts)
    data = timeline(app)

    steps = data["steps"]
    assert [s["index"] for s in steps] == list(range(1, len(steps) + 1))
    assert len(steps) == data["live"]["steps"] == data["next"]["since"]
    assert all(s["duration_s"] > 0 and {"schedule", "forward", "deliver"} <= set(s["stages"]) for s in steps)
    assert sum(s["num_prefill_tokens"] for s in steps) == sum(len(TOKENIZER.encode(p)) for p in prompts)
    assert sum(s["num_sampled"] for s in steps) == sum(counts)
    assert all(s["num_decodes"] + s["num_prefill_tokens"] <= 8 for s in steps)

    events = data["events"]
    assert [e["index"] for e in events] == list(range(1, len(events) + 1)) and data["next"]["events_since"] == len(
        events
    )
    lives = by_request(events)
    assert len(lives) == 4
    step_starts = {s["started_at"] for s in steps if s["num_prefills"]}
    for prompt, n, answer in zip(prompts, counts, answers):
        prompt_tokens = len(TOKENIZER.encode(prompt))
        (life,) = [life for life in lives.values() if life[0]["prompt_tokens"] == prompt_tokens]
        assert [e["kind"] for e in life] == ["arrived", "admitted", "prefill", "decoding", "finished"]
        assert_valid_life(life)
        arrived, admitted, prefill, decoding, done = life
        assert prefill["at"] in step_starts  # the start of the step that scheduled its first chunk
        assert [e["generated_tokens"] for e in life] == [0, 0, 0, 1, n]
        assert done["ttft_s"] == answer["ttft_s"] and done["latency_s"] == answer["latency_s"]


def test_preempted_requests_go_back_to_waiting_and_say_so(make_app):
    # 8 blocks of 16 tokens: four 20-token prompts fit, but not the 60 tokens each then generates.
    app, manager = make_app(kv_cache_blocks=8, block_size=16)
    prompts = [f"request {i}: " + "lighthouse " * 16 for i in range(4)]
    post_all(app, prompts, [60] * 4)
    data = timeline(app)
    preempted = [e for e in data["events"] if e["kind"] == "preempted"]
    assert len(preempted) == data["live"]["preemptions"] > 0
    for life in by_request(data["events"]).values():
        assert_valid_life(life)
        assert life[-1]["kind"] == "finished" and life[-1]["generated_tokens"] == 60
        # after a preemption, the whole context is computed again before decoding resumes
        assert sum(e["kind"] == "prefill" for e in life) == sum(e["kind"] == "preempted" for e in life) + 1
    assert data["steps"][-1]["preemptions"] == data["live"]["preemptions"]
    assert manager.engine.blocks.num_used_blocks == 0


def test_cancelled_and_failed_requests_end_their_rows(make_app):
    # nobatch: one request in the engine, one queued behind it; the loop is held until both time out.
    app, manager = make_app(mode="nobatch", request_timeout_s=0.3)
    gate, step, cancel, cancelled = threading.Event(), manager.engine.step, manager.cancel, []

    def held_step():
        gate.wait()
        return step()

    def cancel_then_release(inf):
        cancel(inf)
        cancelled.append(inf)
        if len(cancelled) == 2:
            gate.set()

    manager.engine.step, manager.cancel = held_step, cancel_then_release
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda p: post(app, p, 50), ["a b", "c d"]))
    assert [a.status_code for a in answers] == [504, 504]
    lives = sorted(by_request(timeline(app)["events"]).values(), key=len)
    assert [[e["kind"] for e in life] for life in lives] == [
        ["arrived", "cancelled"],  # never left the queue
        ["arrived", "admitted", "prefill", "decoding", "cancelled"],  # ran its held step, then was aborted
    ]

    app, manager = make_app()
    manager.engine.step = lambda: (_ for _ in ()).throw(RuntimeError("simulated failure"))
    assert post(app, "doomed", 3).status_code == 500
    assert [e["kind"] for e in timeline(app)["events"]] == ["arrived", "admitted", "failed"]


def test_a_constrained_request_carries_its_kind_on_every_event_a_free_one_none(make_app):
    app, _ = make_app()
    asked = [("regex", {"guided_regex": "[a-z]{1,4}"}), ("choice", {"guided_choice": ["yes", "no"]})]
    for kind, constraint in asked:  # one at a time: request ids follow this order
        body = {"prompt": f"a {kind}:", "max_tokens": 6, "temperature": 0, **constraint}
        answer = app.test_client().post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.get_data(as_text=True)
        text = answer.get_json()["choices"][0]["text"]
        assert re.fullmatch("[a-z]{1,4}", text) if kind == "regex" else text in ("yes", "no")
    assert post(app, "free", 3).status_code == 200
    lives = [lives for _, lives in sorted(by_request(timeline(app)["events"]).items())]
    assert len(lives) == 3
    for life, kind in zip(lives, ["regex", "choice", None]):
        assert_valid_life(life)
        assert [e["constraint"] for e in life] == [kind] * len(life), life


def test_the_rings_keep_only_the_latest_records(make_app):
    app, _ = make_app(mode="nobatch", step_log_size=4, request_event_log_size=6)
    for i in range(5):
        assert post(app, f"request {i}", 3).status_code == 200  # 3 steps and 5 events each
    data = timeline(app)
    assert [s["index"] for s in data["steps"]] == [12, 13, 14, 15]
    assert [e["index"] for e in data["events"]] == [20, 21, 22, 23, 24, 25]
    assert data["next"] == {"since": 15, "events_since": 25}
    assert timeline(app, since=14, events_since=24)["next"] == {"since": 15, "events_since": 25}
    assert [s["index"] for s in timeline(app, since=14)["steps"]] == [15]


def test_since_paging_under_load_returns_every_record_once(make_app):
    app, _ = make_app(max_batch_tokens=16)
    prompts = [f"request {i} " + "water " * (i * 3) for i in range(12)]
    pages, since, events_since = [], 0, 0
    with ThreadPoolExecutor(12) as pool:
        load = pool.map(lambda i: post(app, prompts[i], 20 + i), range(12))
        deadline = time.monotonic() + 60
        while not pages or pages[-1]["live"]["requests_running"] or pages[-1]["live"]["requests_waiting"]:
            assert time.monotonic() < deadline, "the requests did not finish before the deadline"
            time.sleep(0.02)  # a poll interval, as the dashboard's: polling flat out starves the engine's thread
            page = timeline(app, since, events_since)
            pages.append(page)
            since, events_since = page["next"]["since"], page["next"]["events_since"]
        assert {a.status_code for a in load} == {200}
    pages.append(timeline(app, since, events_since))
    everything = timeline(app)
    steps = [s for p in pages for s in p["steps"]]
    events = [e for p in pages for e in p["events"]]
    assert steps == everything["steps"] and events == everything["events"]  # nothing twice, nothing missed
    assert len(pages) > 2 and len(by_request(events)) == 12


def test_bad_cursors_get_400(make_app):
    app, _ = make_app()
    for query in ("since=-1", "since=x", "events_since=1.5"):
        answer = app.test_client().get(f"/stats/timeline?{query}")
        assert answer.status_code == 400 and "must be a non-negative integer" in answer.get_json()["error"]["message"]


def test_the_page_is_open_its_data_needs_the_key(make_app):
    app, _ = make_app(api_key="s3cret")
    client = app.test_client()
    page = client.get("/dashboard")
    assert page.status_code == 200 and 'data-key-required="true"' in page.get_data(as_text=True)
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    for asset, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        answer = client.get(f"/dashboard/{asset}")
        assert answer.status_code == 200 and answer.mimetype == kind
    refused = client.get("/stats/timeline")
    assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"
    assert client.get("/stats/timeline", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/dashboard/app.py").status_code == 401  # not a page file: guarded like the rest
    assert client.get("/dashboard/app.py", headers={"Authorization": "Bearer s3cret"}).status_code == 404
    data = timeline(app, Authorization="Bearer s3cret")
    assert data["server"]["mode"] == "dynamic" and data["server"]["random_weights"] is False

    open_app, _ = make_app()
    assert 'data-key-required="false"' in open_app.test_client().get("/dashboard").get_data(as_text=True)


# --- /stats and /metrics ---------------------------------------------------------------------------
def metrics(app) -> dict[tuple[str, tuple], float]:
    text = app.test_client().get("/metrics").get_data(as_text=True)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_stats_and_metrics_count_the_steps(make_app):
    # nobatch, prompts within one step's budget: each request is one prefill step, then a step per token.
    app, _ = make_app(mode="nobatch")
    counts = [4, 5, 6]
    for i, n in enumerate(counts):
        assert post(app, f"request {i}", n).status_code == 200
    stats = app.test_client().get("/stats").get_json()
    recent = stats["recent_steps"]
    assert stats["steps"] == recent["steps"] == sum(counts)
    assert recent["steps_with_prefill"] == len(counts)
    assert 0 < recent["step_time_s"]["p50"] <= recent["step_time_s"]["p99"]
    stage_sum = sum(recent["stage_time_s"].values())
    assert set(recent["stage_time_s"]) == set(STAGES) and all(v > 0 for v in recent["stage_time_s"].values())
    assert 0.5 * recent["step_time_s"]["mean"] < stage_sum <= recent["step_time_s"]["mean"] * (1 + 1e-9)

    samples = metrics(app)
    assert samples[("gpt2_steps_total", ())] == sum(counts)
    assert samples[("gpt2_recent_steps", ())] == sum(counts)
    assert samples[("gpt2_recent_steps_with_prefill", ())] == len(counts)
    assert samples[("gpt2_recent_step_seconds", (("stat", "p99"),))] == recent["step_time_s"]["p99"]
    for stage in STAGES:
        assert samples[("gpt2_recent_step_stage_seconds", (("stage", stage),))] == recent["stage_time_s"][stage]


def test_stats_and_metrics_show_the_same_live_values(make_app):
    app, _ = make_app(kv_cache_blocks=300)
    # the first alone, so that its prompt's blocks are cached before the others arrive
    assert post(app, "shared prefix " * 10 + "0", 2).status_code == 200
    post_all(app, ["shared prefix " * 10 + str(i) for i in (1, 2)], [3, 4])
    stats = app.test_client().get("/stats").get_json()
    samples = metrics(app)
    model = (("model_name", stats["model"]),)
    for value in LIVE_VALUES:
        suffix = "_total" if value.kind == "counter" else ""
        names = [(value.metric, ())] if value.metric else []
        names += [(name, model) for name in value.vllm]  # vLLM's series: the same value, labelled model_name
        for name, labels in names:
            shown = stats[value.key] if value.label else {None: stats[value.key]}
            for label_value, number in shown.items():
                key = labels + (((value.label, label_value),) if value.label else ())
                assert samples[(name + suffix, tuple(sorted(key)))] == number, (name, label_value)
    assert stats["kv_blocks_total"] == 300 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["prefix_cache_hit_rate"] == stats["prefix_cache_hit_tokens"] / stats["prefix_cache_query_tokens"]
    # every key scripts and tests read before these figures had one home
    old = {"requests_running", "requests_waiting", "kv_blocks_used", "kv_blocks_cached", "kv_blocks_evictable"}
    old |= {"evictions", "preemptions", "kv_cache_integrity", "steps", "mode", "model", "prefix_cache", "throughput"}
    assert old <= stats.keys()
    names = {"gpt2_requests_running", "gpt2_requests_waiting", "gpt2_kv_blocks_used", "gpt2_kv_blocks_total"}
    names |= {"gpt2_kv_blocks_cached", "gpt2_prefix_cache_hit_tokens_total", "gpt2_prefix_cache_query_tokens_total"}
    names |= {"gpt2_preemptions_total", "gpt2_kv_evictions_total", "gpt2_requests_total", "gpt2_ttft_seconds_bucket"}
    assert names <= {name for name, _ in samples}
