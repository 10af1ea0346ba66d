"""Tenants kept apart, the operator's endpoints guarded, and no request that can stall or kill the server,
over HTTP against real servers (./server.sh dynamic) with a keys file of tenants and an operator:

- the Batch API: another key's file or batch is a 404, word for word a missing one's, wherever an id is
  taken; DELETE /v1/files/{id} for its owner alone; quotas of stored bytes and open batches (429); files
  and batches removed after BATCH_RETENTION_S; batches of several tenants shared in turn; a line refused
  for load retried a few times, backing off, then failed; a result that cannot be written fails its line
  with the error; a batch past its window expires with what it finished;
- LoRA loading: 404 by default, 403 for a tenant, 200 for the operator, and a path outside LORA_ROOT
  refused in the same words as a missing one;
- /stats, /metrics and /stats/timeline show a tenant its own figures and requests, the operator all;
- a 0.8 MB grammar of newlines and a 200,000-character stop string are a 400 within a second while /health
  answers within 0.5 s; a request failing inside a step (FAULT_FAIL_MARKER) fails alone;
- `priority` below the key's min_priority and a `user` naming a keyed tenant are 400s naming the field.
"""

import contextlib
import io
import json
import os
import shutil
import signal
import threading
import time

import pytest
import requests
from conftest import sim_settings
from test_admission import metric

from client.launch import start_server, stop_server
from config import Settings

# Two tenants, one allowed priorities down to -5, one that may have a single sequence waiting, and the operator.
KEYS = {
    "tenants": {
        "alice": {"keys": ["alice-key"]},
        "bob": {"keys": ["bob-key"], "min_priority": -5},
        "carol": {"keys": ["carol-key"], "max_waiting": 1},
        "ops": {"keys": ["ops-key"], "admin": True},
    }
}
MARKER = "<fail in this step>"
DEADLINE_S = 120


class Api:
    """One server's endpoints, called with one key."""

    def __init__(self, url: str, key: str):
        self.url, self.headers = url, {"Authorization": f"Bearer {key}"}

    def get(self, path: str, **params) -> requests.Response:
        return requests.get(f"{self.url}{path}", params=params, headers=self.headers, timeout=60)

    def post(self, path: str, body: dict | None = None, **kwargs) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=body, headers=self.headers, timeout=60, **kwargs)

    def delete(self, path: str) -> requests.Response:
        return requests.delete(f"{self.url}{path}", headers=self.headers, timeout=60)

    def upload(self, lines: list[dict], padding: int = 0) -> requests.Response:
        text = "".join(json.dumps(line) + "\n" for line in lines) + " " * padding
        files = {"file": ("requests.jsonl", io.BytesIO(text.encode()))}
        return requests.post(f"{self.url}/v1/files", data={"purpose": "batch"}, files=files, headers=self.headers)

    def batch(self, lines: list[dict]) -> dict:
        """A completions batch over a fresh upload of `lines`."""
        file_id = self.upload(lines).json()["id"]
        body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
        created = self.post("/v1/batches", body)
        assert created.status_code == 200, created.text
        return created.json()

    def poll(self, batch_id: str, until, deadline_s: float = DEADLINE_S) -> dict:
        deadline = time.monotonic() + deadline_s
        while not until(batch := self.get(f"/v1/batches/{batch_id}").json()):
            assert time.monotonic() < deadline, f"batch {batch_id}: {batch}"
            time.sleep(0.1)  # polling interval under a deadline
        return batch

    def records(self, file_id: str) -> list[dict]:
        return [json.loads(line) for line in self.get(f"/v1/files/{file_id}/content").text.splitlines()]


def line(custom_id: str, max_tokens: int = 4, **body) -> dict:
    completion = {"prompt": f"Request {custom_id} says", "max_tokens": max_tokens, "ignore_eos": True, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": completion}


def error(response: requests.Response) -> dict:
    return response.json()["error"]


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    return str(path)


@contextlib.contextmanager
def server(tmp_path_factory, keys_file: str, **settings: str):
    """A server over its own DATA_DIR, with the keys file and API_KEY beside it: (url, DATA_DIR, proc)."""
    directory = tmp_path_factory.mktemp("server")
    data = directory / "data"
    proc, url = start_server(
        "dynamic", directory, API_KEYS_FILE=keys_file, API_KEY="master", DATA_DIR=str(data), **settings
    )
    try:
        yield url, data, proc
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_checkpoint, lora_adapters, keys_file):
    """The tiny model, runtime LoRA loading from the adapters' directory, small Batch API quotas, the fault hook."""
    with server(
        tmp_path_factory,
        keys_file,
        MODEL=str(tiny_checkpoint),
        KV_CACHE_BLOCKS="4096",
        ALLOW_RUNTIME_LORA_UPDATING="true",
        LORA_ROOT=str(lora_adapters["alpha"].parent),
        BATCH_TENANT_MAX_BYTES=str(1 << 20),
        BATCH_TENANT_MAX_BATCHES="2",
        FAULT_FAIL_MARKER=MARKER,
    ) as started:
        yield started


@pytest.fixture(scope="module")
def slow(tmp_path_factory, keys_file):
    """A simulated engine whose every step takes 20 ms, one Batch API request at a time, two retries."""
    settings = sim_settings(tmp_path_factory.mktemp("sim"), 0.02)
    with server(tmp_path_factory, keys_file, **settings, BATCH_IN_FLIGHT="1", BATCH_MAX_RETRIES="2") as started:
        yield started


# --- the Batch API -----------------------------------------------------------------------------------


def test_files_and_batches_are_their_owners_alone_and_anothers_are_404_like_missing_ones(tiny):
    url, data, _ = tiny
    alice, bob, ops, master = (Api(url, k) for k in ("alice-key", "bob-key", "ops-key", "master"))
    batch = alice.batch([line(f"r{i}") for i in range(3)])
    done = alice.poll(batch["id"], lambda b: b["status"] == "completed")
    file_ids = (batch["input_file_id"], done["output_file_id"], done["error_file_id"])
    assert "owner" not in done and "tenant" not in done and "owner" not in alice.get(f"/v1/files/{file_ids[0]}").json()

    def refusals(api: Api, file_id: str, batch_id: str) -> list[requests.Response]:
        create = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
        return [
            api.get(f"/v1/files/{file_id}"),
            api.get(f"/v1/files/{file_id}/content"),
            api.delete(f"/v1/files/{file_id}"),
            api.get(f"/v1/batches/{batch_id}"),
            api.post(f"/v1/batches/{batch_id}/cancel"),
            api.post("/v1/batches", create),
        ]

    missing = [(r.status_code, error(r)) for r in refusals(alice, "file-nope", "batch_nope")]
    for other in (bob, master):  # another tenant's key, and API_KEY's holder (no operator beside a keys file)
        for file_id in file_ids:
            got = [(r.status_code, error(r)) for r in refusals(other, file_id, batch["id"])]
            named = [(status, {**e, "message": unnamed(e["message"], file_id, batch["id"])}) for status, e in got]
            assert named == missing and all(status == 404 for status, _ in got)
        assert other.get("/v1/batches").json()["data"] == [] and other.get("/v1/files").json()["data"] == []
    for owner in (alice, ops):  # the owner, and the operator
        assert batch["id"] in [b["id"] for b in owner.get("/v1/batches").json()["data"]]
        assert set(file_ids) <= {f["id"] for f in owner.get("/v1/files").json()["data"]}
        assert len(owner.records(done["output_file_id"])) == 3
    assert alice.delete(f"/v1/files/{file_ids[0]}").json() == {"id": file_ids[0], "object": "file", "deleted": True}
    assert alice.get(f"/v1/files/{file_ids[0]}").status_code == 404
    assert not any(p.name.startswith(file_ids[0]) for p in (data / "files").iterdir())


def unnamed(message: str, file_id: str, batch_id: str) -> str:
    """An error message with the ids it names as the missing ones' ids."""
    return message.replace(file_id, "file-nope").replace(batch_id, "batch_nope")


def test_a_file_in_use_is_not_deleted_and_quotas_of_bytes_and_open_batches_are_429(tiny):
    url, _, _ = tiny
    bob = Api(url, "bob-key")
    slow_lines = [line(f"s{i}", max_tokens=300) for i in range(4)]
    first, second = bob.batch(slow_lines), bob.batch(slow_lines)
    in_use = bob.delete(f"/v1/files/{first['input_file_id']}")
    assert in_use.status_code == 409 and first["id"] in error(in_use)["message"]
    third = bob.upload(slow_lines)
    refused = bob.post("/v1/batches", {"input_file_id": third.json()["id"], "endpoint": "/v1/completions",
                                       "completion_window": "24h"})  # fmt: skip
    assert refused.status_code == 429 and error(refused)["param"] == "input_file_id"
    assert "BATCH_TENANT_MAX_BATCHES" in error(refused)["message"]
    assert Api(url, "alice-key").batch([line("a")])["status"] == "validating"  # another tenant's quota is its own
    for batch in (first, second):
        assert bob.post(f"/v1/batches/{batch['id']}/cancel").status_code == 200
    for batch in (first, second):  # cancelled, or completed before its cancel came: ended either way
        bob.poll(batch["id"], lambda b: b["status"] in ("cancelled", "completed"))
    assert bob.delete(f"/v1/files/{first['input_file_id']}").status_code == 200
    big = [bob.upload([line("big")], padding=400_000) for _ in range(3)]  # 1 MiB each tenant: the third is over
    assert [r.status_code for r in big] == [200, 200, 429]
    assert error(big[2])["param"] == "file" and "BATCH_TENANT_MAX_BYTES" in error(big[2])["message"]
    assert bob.delete(f"/v1/files/{big[0].json()['id']}").status_code == 200
    assert bob.upload([line("big")], padding=400_000).status_code == 200


def test_retention_removes_files_and_ended_batches(tmp_path_factory, keys_file):
    settings = sim_settings(tmp_path_factory.mktemp("sim"), 0.001)
    with server(tmp_path_factory, keys_file, **settings, BATCH_RETENTION_S="2") as (url, data, _):
        alice = Api(url, "alice-key")
        kept = alice.upload([line("r")]).json()
        assert kept["expires_at"] == kept["created_at"] + 2
        batch = alice.batch([line("b")])
        done = alice.poll(batch["id"], lambda b: b["status"] == "completed")
        assert alice.get(f"/v1/files/{done['output_file_id']}").json()["expires_at"] == done["completed_at"] + 2
        deadline = time.monotonic() + 30
        while alice.get(f"/v1/batches/{batch['id']}").status_code != 404 or any((data / "files").iterdir()):
            assert time.monotonic() < deadline, list((data / "files").iterdir())
            time.sleep(0.1)  # polling interval under a deadline
        for path in (f"/v1/files/{kept['id']}", f"/v1/files/{done['output_file_id']}/content"):
            assert alice.get(path).status_code == 404
        assert not list((data / "batches").iterdir())


def test_batches_of_two_tenants_are_run_in_turn_not_oldest_first(slow):
    url, _, _ = slow
    alice, bob = Api(url, "alice-key"), Api(url, "bob-key")
    older = [alice.batch([line(f"a{b}-{i}", max_tokens=10) for i in range(8)]) for b in range(2)]
    newer = bob.batch([line(f"b{i}", max_tokens=10) for i in range(3)])
    bob.poll(newer["id"], lambda b: b["status"] == "completed")
    first, second = (alice.get(f"/v1/batches/{b['id']}").json() for b in older)
    # oldest first, bob's batch would have waited for all 16 of alice's requests
    assert first["request_counts"]["completed"] < 8 and second["status"] == "validating"


def test_a_line_refused_for_load_is_tried_again_backing_off_then_fails(slow):
    url, _, _ = slow
    carol, ops = Api(url, "carol-key"), Api(url, "ops-key")
    began = time.monotonic()
    batch = carol.batch([line("two", n=2)])  # two sequences: always past carol's max_waiting of 1, a 429
    done = carol.poll(batch["id"], lambda b: b["status"] == "completed")
    (record,) = carol.records(done["error_file_id"])
    assert record["response"]["status_code"] == 429 and record["error"]["code"] == "429"
    assert done["request_counts"] == {"total": 1, "completed": 0, "failed": 1}
    assert ops.get("/stats").json()["tenant_requests_refused"]["carol"] == 3  # tried once, then BATCH_MAX_RETRIES
    assert time.monotonic() - began >= 1 + 2  # the pauses before the two retries


def test_a_result_that_cannot_be_written_fails_its_line_with_the_error(slow):
    url, data, _ = slow
    alice = Api(url, "alice-key")
    batch = alice.batch([line(f"w{i}", max_tokens=40) for i in range(4)])
    alice.poll(batch["id"], lambda b: b["status"] == "in_progress")
    output = data / "files" / f"file-{batch['id'].removeprefix('batch_')}-output.data"
    output.rename(output.with_suffix(".kept"))
    output.symlink_to("/dev/full")  # a full disk: every write fails with ENOSPC
    done = alice.poll(batch["id"], lambda b: b["status"] == "completed")
    output.unlink()
    output.with_suffix(".kept").rename(output)  # what was written before (reading /dev/full never ends)
    written, failed = alice.records(done["output_file_id"]), alice.records(done["error_file_id"])
    assert sorted(r["custom_id"] for r in written + failed) == [f"w{i}" for i in range(4)]
    assert failed and all(r["error"]["code"] == "write_failed" for r in failed)
    assert all("No space left on device" in r["error"]["message"] for r in failed)
    assert done["request_counts"] == {"total": 4, "completed": len(written), "failed": len(failed)}


def test_a_batch_past_its_window_expires_with_what_it_finished(tmp_path_factory, keys_file):
    settings = sim_settings(tmp_path_factory.mktemp("sim"), 0.02)
    with server(tmp_path_factory, keys_file, **settings, BATCH_IN_FLIGHT="1") as (url, data, proc):
        alice = Api(url, "alice-key")
        batch = alice.batch([line(f"e{i}", max_tokens=20) for i in range(10)])
        alice.poll(batch["id"], lambda b: b["request_counts"]["completed"] >= 2)
        os.killpg(proc.pid, signal.SIGKILL)  # stopped mid-batch; its window then closes while it is down
        proc.wait()
    alice = Api(url, "alice-key")
    stored = data / "batches" / f"{batch['id']}.json"
    stored.write_text(json.dumps({**json.loads(stored.read_text()), "expires_at": int(time.time()) - 1}))
    port = int(url.rsplit(":", 1)[1])
    again, _ = start_server("dynamic", data.parent, port=port, API_KEYS_FILE=keys_file, DATA_DIR=str(data),
                            API_KEY="master", **settings)  # fmt: skip
    try:
        done = alice.poll(batch["id"], lambda b: b["status"] == "expired")
        written, failed = alice.records(done["output_file_id"]), alice.records(done["error_file_id"])
        assert sorted(r["custom_id"] for r in written + failed) == sorted(f"e{i}" for i in range(10))
        assert len(written) >= 2 and all(r["error"]["code"] == "batch_expired" for r in failed)
        assert done["request_counts"] == {"total": 10, "completed": len(written), "failed": len(failed)}
        assert done["expired_at"] >= done["expires_at"]
    finally:
        stop_server(again)


# --- the operator's endpoints and figures ------------------------------------------------------------


def test_lora_loading_is_off_by_default_the_operators_alone_and_only_under_lora_root(
    url, tiny, lora_adapters, tmp_path
):
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # the shared server, default settings
        assert requests.post(f"{url}{route}", json={"lora_name": "beta"}, timeout=30).status_code == 404
    served, _, _ = tiny
    alice, ops = Api(served, "alice-key"), Api(served, "ops-key")
    load = {"lora_name": "beta", "lora_path": str(lora_adapters["beta"])}
    refused = alice.post("/v1/load_lora_adapter", load)
    assert refused.status_code == 403 and error(refused)["type"] == "permission_error"
    assert ops.post("/v1/load_lora_adapter", load).status_code == 200
    assert alice.post("/v1/completions", {"model": "beta", "prompt": "Hi", "max_tokens": 3}).status_code == 200
    outside = shutil.copytree(lora_adapters["gamma"], tmp_path / "gamma")  # a good adapter, outside LORA_ROOT
    escape = lora_adapters["alpha"].parent / "escape"
    escape.symlink_to(outside)  # under LORA_ROOT, resolving outside it
    try:
        words = set()
        for path in (str(outside), str(escape), str(lora_adapters["alpha"].parent / "nope"), "nope"):
            answer = ops.post("/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": path})
            assert answer.status_code == 400 and error(answer)["param"] == "lora_path"
            words.add(error(answer)["message"].replace(repr(path), "PATH"))
        assert len(words) == 1 and "cannot load adapter" in words.pop()
    finally:
        escape.unlink()
    assert alice.post("/v1/unload_lora_adapter", {"lora_name": "beta"}).status_code == 403
    assert ops.post("/v1/unload_lora_adapter", {"lora_name": "beta"}).status_code == 200


def test_stats_metrics_and_timeline_show_a_tenant_its_own_and_the_operator_all(tiny):
    url, _, _ = tiny
    alice, bob, ops, master = (Api(url, k) for k in ("alice-key", "bob-key", "ops-key", "master"))
    cursor = ops.get("/stats/timeline").json()["next"]
    for api in (alice, bob):
        assert api.post("/v1/completions", {"prompt": "Hello", "max_tokens": 3}).status_code == 200
    tenants = lambda api: set(api.get("/stats").json()["tenant_generated_tokens"])  # noqa: E731
    assert (tenants(alice), tenants(bob), tenants(master)) == ({"alice"}, {"bob"}, set())
    assert {"alice", "bob"} <= tenants(ops)
    for api, own, other in ((alice, "alice", "bob"), (bob, "bob", "alice")):
        text = api.get("/metrics").text
        assert metric(text, "gpt2_tenant_generated_tokens_total", tenant=own) >= 3
        assert f'tenant="{other}"' not in text and "vllm:lora_requests_info" not in text
    assert 'tenant="bob"' in ops.get("/metrics").text and "vllm:lora_requests_info" in ops.get("/metrics").text
    requests_seen = lambda api: {e["request"] for e in api.get("/stats/timeline", **cursor).json()["events"]}  # noqa: E731
    mine, theirs = requests_seen(alice), requests_seen(bob)
    assert len(mine) == len(theirs) == 1 and mine != theirs and mine | theirs <= requests_seen(ops)
    assert set(alice.get("/stats/timeline", **cursor).json()["live"]["tenant_generated_tokens"]) == {"alice"}


# --- requests that must not stall or kill the server, nor reach past their key -----------------------


def test_long_constraints_and_stop_strings_are_400s_at_once_while_health_answers(url):
    latencies, done = [], threading.Event()

    def watch_health() -> None:
        while not done.is_set():
            began = time.monotonic()
            assert requests.get(f"{url}/health", timeout=10).status_code == 200
            latencies.append(time.monotonic() - began)

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    try:
        newlines = "\n" * 400_000  # 0.8 MB of JSON: a quadratic check of it would hold the interpreter for minutes
        bodies = {
            "guided_grammar": {"guided_grammar": 'start: "a"' + newlines},
            "structured_outputs": {"structured_outputs": {"grammar": 'root ::= "a"' + newlines}},
            "stop": {"stop": "x" * 200_000},
        }
        for field, extra in bodies.items():
            began = time.monotonic()
            answer = requests.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **extra}, timeout=60)
            assert time.monotonic() - began < 1 and answer.status_code == 400 and error(answer)["param"] == field
    finally:
        done.set()
        watcher.join()
    assert latencies and max(latencies) < 0.5


def test_a_request_failing_inside_a_step_fails_alone_and_the_others_finish(tiny):
    url, _, _ = tiny
    alice, bob = Api(url, "alice-key"), Api(url, "bob-key")
    body = {"max_tokens": 30, "ignore_eos": True, "temperature": 0}
    answers: dict[str, requests.Response] = {}
    sends = {
        "alice": lambda: alice.post("/v1/completions", {**body, "prompt": "The lighthouse"}),
        "bob": lambda: bob.post("/v1/completions", {**body, "prompt": "Once upon a time"}),
        "faulty": lambda: alice.post("/v1/completions", {**body, "prompt": f"One {MARKER} two"}),
        "faulty streamed": lambda: bob.post("/v1/completions", {**body, "prompt": f"{MARKER}", "stream": True}),
    }
    threads = [threading.Thread(target=lambda k=k, s=s: answers.__setitem__(k, s())) for k, s in sends.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers["alice"].status_code == answers["bob"].status_code == 200
    assert [answers[k].json()["usage"]["completion_tokens"] for k in ("alice", "bob")] == [30, 30]
    failed = answers["faulty"]
    assert failed.status_code == 500 and error(failed)["type"] == "server_error"
    assert "FAULT_FAIL_MARKER" in error(failed)["message"]
    events = [json.loads(e[6:]) for e in answers["faulty streamed"].text.split("\n\n") if e.startswith("data: {")]
    assert "FAULT_FAIL_MARKER" in events[-1]["error"]["message"]
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    assert alice.post("/v1/completions", {**body, "prompt": "After"}).status_code == 200


@pytest.mark.parametrize(
    "key, priority, status",
    [("alice-key", -1, 400), ("alice-key", 0, 200), ("bob-key", -5, 200), ("bob-key", -6, 400),
     ("ops-key", -1, 400), ("master", -1, 400), ("alice-key", -1000, 400)],
)  # fmt: skip
def test_a_priority_more_urgent_than_the_keys_min_priority_is_refused(tiny, key, priority, status):
    answer = Api(tiny[0], key).post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": priority})
    assert answer.status_code == status
    if status == 400:
        assert error(answer)["param"] == "priority" and "min_priority" in error(answer)["message"]


def test_a_user_field_cannot_name_a_keyed_tenant(tiny):
    master = Api(tiny[0], "master")
    named = master.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "user": "alice"})
    assert named.status_code == 400 and error(named)["param"] == "user"
    assert master.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "user": "dave"}).status_code == 200


@pytest.mark.parametrize(
    "env, words",
    [
        ({"ALLOW_RUNTIME_LORA_UPDATING": "true"}, "ALLOW_RUNTIME_LORA_UPDATING needs LORA_ROOT"),
        ({"ALLOW_RUNTIME_LORA_UPDATING": "maybe"}, "ALLOW_RUNTIME_LORA_UPDATING must be on or off"),
        ({"LORA_ROOT": "/no/such/directory"}, "LORA_ROOT must be a directory"),
        ({"BATCH_RETENTION_S": "-1"}, "BATCH_RETENTION_S"),
        ({"BATCH_RETENTION_S": "inf"}, "BATCH_RETENTION_S"),
        ({"BATCH_TENANT_MAX_BYTES": "-1"}, "BATCH_TENANT_MAX_BYTES"),
        ({"BATCH_TENANT_MAX_BATCHES": "-1"}, "BATCH_TENANT_MAX_BATCHES"),
        ({"BATCH_MAX_RETRIES": "-1"}, "BATCH_MAX_RETRIES"),
    ],
)
def test_a_bad_setting_stops_the_start_naming_it(monkeypatch, tmp_path, env, words):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=words):
        Settings.from_env(str(tmp_path / "no.env"))


def test_the_operators_key_is_never_logged():
    settings = Settings(admin_api_key="operator-secret", api_key="shared-secret")
    assert "secret" not in repr(settings.redacted())
