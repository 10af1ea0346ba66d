"""API_SERVER_COUNT=2: two front ends (gunicorn workers) and one Batch API (api/batch_owner.py), over HTTP
against a real server with a keys file: every request sees the same files whichever worker takes it, large
uploads included; a batch runs once (each line answered once, its counts right), is read and cancelled
through any worker, and is its owner's alone (another key's 404 is a missing id's); the owner killed with
kill -9, another worker takes over and finishes its batch with each line answered once. And in process: a
forwarded request waits for an owner, then is a 503; the owner's socket serves the Batch API alone."""

import fcntl
import json
import os
import signal
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from flask import Flask, jsonify

from api import batch_owner, batches
from api.errors import ApiError
from batching.batch_jobs import BatchJobs
from batching.batch_store import BatchStore
from config import BatchApiSettings
from tests.conftest import wait_until
from tests.test_engine_process import alive, children
from tests.test_tenant_isolation import KEYS, Api, error, line, server, unnamed

# The layout under test, in one place: two front ends on one engine process. (With ENGINE_PROCESS=off, where
# config.py allows it, each worker has an engine of its own, which changes nothing for the Batch API.)
LAYOUT = {"API_SERVER_COUNT": "2", "ENGINE_PROCESS": "on"}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_checkpoint):
    """The server: (url, its DATA_DIR, its gunicorn master's process id)."""
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    settings = {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "1024", "BATCH_IN_FLIGHT": "2", **LAYOUT}
    with server(tmp_path_factory, str(keys), **settings) as (url, data, proc):
        yield url, data, proc.pid  # server.sh execs gunicorn


def owner(data) -> int:
    """The Batch API's owner: the worker whose process id its address file names."""
    return json.loads((data / batch_owner.ADDRESS_FILE).read_text())["pid"]


def in_parallel(calls: list) -> list:
    """Each call at once, on a thread of its own: enough connections at a time that both workers take some."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def test_every_worker_sees_the_same_files(served):
    url, data, master = served
    alice = Api(url, "alice-key")
    uploads = in_parallel([lambda i=i: alice.upload([line(f"f{i}")]) for i in range(3)])
    big = alice.upload([line("big")], padding=1_500_000)  # past MAX_BODY_BYTES (1 MiB), within an upload's limit
    assert [r.status_code for r in [*uploads, big]] == [200] * 4, [r.text for r in [*uploads, big]]
    ids = {r.json()["id"] for r in [*uploads, big]}
    assert owner(data) in children(master)
    lists = in_parallel([lambda: alice.get("/v1/files")] * 10)
    infos = in_parallel([lambda i=i: alice.get(f"/v1/files/{sorted(ids)[i % 4]}") for i in range(10)])
    assert all(r.status_code == 200 for r in lists + infos)
    assert all({f["id"] for f in r.json()["data"]} == ids for r in lists)
    assert Counter(r.json()["id"] for r in infos) == Counter(sorted(ids)[i % 4] for i in range(10))
    content = alice.get(f"/v1/files/{big.json()['id']}/content")
    assert content.headers["Content-Type"] == "application/jsonl" and len(content.content) > 1_500_000


def test_a_batch_runs_once_is_read_through_any_worker_and_is_its_owners_alone(served):
    url, _, _ = served
    alice, bob, ops = (Api(url, key) for key in ("alice-key", "bob-key", "ops-key"))
    batch = alice.batch([line(f"r{i}") for i in range(8)])
    polls = in_parallel([lambda: alice.poll(batch["id"], lambda b: b["status"] == "completed")] * 6)
    assert {b["request_counts"]["completed"] for b in polls} == {8}
    done = polls[0]
    assert done["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
    assert Counter(r["custom_id"] for r in alice.records(done["output_file_id"])) == {f"r{i}": 1 for i in range(8)}
    assert batch["id"] in [b["id"] for b in ops.get("/v1/batches").json()["data"]]
    for path in ("/v1/files/{file}", "/v1/files/{file}/content", "/v1/batches/{batch}"):
        theirs = bob.get(path.format(file=batch["input_file_id"], batch=batch["id"]))
        missing = bob.get(path.format(file="file-nope", batch="batch_nope"))
        assert theirs.status_code == missing.status_code == 404
        assert {**error(theirs), "message": unnamed(error(theirs)["message"], batch["input_file_id"], batch["id"])} == (
            error(missing)
        )
    assert bob.post(f"/v1/batches/{batch['id']}/cancel").status_code == 404
    assert bob.get("/v1/batches").json()["data"] == [] and bob.get("/v1/files").json()["data"] == []


def test_a_batch_is_cancelled_through_any_worker(served):
    url, _, _ = served
    alice = Api(url, "alice-key")
    batch = alice.batch([line(f"c{i}", max_tokens=40) for i in range(40)])
    alice.poll(batch["id"], lambda b: b["request_counts"]["completed"] >= 1)
    assert alice.post(f"/v1/batches/{batch['id']}/cancel").json()["status"] in ("cancelling", "cancelled")
    done = alice.poll(batch["id"], lambda b: b["status"] == "cancelled")
    out = alice.records(done["output_file_id"])
    assert len(out) == done["request_counts"]["completed"] == len({r["custom_id"] for r in out}) < 40


def test_the_owner_killed_another_worker_takes_over_and_finishes_its_batch(served):
    """Last: it kills a worker of the module's server (gunicorn starts another)."""
    url, data, master = served
    alice = Api(url, "alice-key")
    batch = alice.batch([line(f"k{i}", max_tokens=40) for i in range(30)])
    under_way = alice.poll(batch["id"], lambda b: b["request_counts"]["completed"] >= 3)
    assert under_way["request_counts"]["completed"] < 30
    killed = owner(data)
    os.kill(killed, signal.SIGKILL)  # no goodbye: its requests in flight are gone, and the lock with it
    wait_until(lambda: owner(data) != killed and alive(owner(data)) and owner(data) in children(master))
    done = alice.poll(batch["id"], lambda b: b["status"] == "completed")
    assert done["request_counts"] == {"total": 30, "completed": 30, "failed": 0}
    assert Counter(r["custom_id"] for r in alice.records(done["output_file_id"])) == {f"k{i}": 1 for i in range(30)}
    assert not alice.records(done["error_file_id"])


def test_a_forwarded_request_waits_for_an_owner_and_its_socket_serves_the_batch_api_alone(tmp_path, monkeypatch):
    """In process, on an app of the Batch API's routes and /health: the lock held elsewhere, then let go."""
    monkeypatch.setattr(batch_owner, "OWNER_WAIT_S", 0.3)
    app = Flask(__name__)
    app.register_blueprint(batches.routes)
    app.errorhandler(ApiError)(lambda err: (jsonify(err.body()), err.status, err.headers))
    app.get("/health")(lambda: "ok")
    jobs = BatchJobs(BatchStore(str(tmp_path)), None, lambda: False, 0, 1)  # not started: its files are enough
    with open(tmp_path / batch_owner.LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # an owner that never publishes its socket
        batch_owner.share(app, BatchApiSettings(data_dir=str(tmp_path)), lambda: jobs)
        waited = app.test_client().get("/v1/files")
        assert waited.status_code == 503 and waited.headers["Retry-After"] == "1"
        problem = waited.get_json()["error"]
        assert problem["type"] == "unavailable" and "no worker serves the Batch API" in problem["message"]
    wait_until(lambda: app.extensions.get("batch_jobs") is jobs and (tmp_path / batch_owner.ADDRESS_FILE).exists())
    assert app.test_client().get("/v1/files").get_json()["data"] == []  # the owner's own: served in place
    address = json.loads((tmp_path / batch_owner.ADDRESS_FILE).read_text())
    assert address["pid"] == os.getpid() and os.stat(os.path.dirname(address["socket"])).st_mode & 0o077 == 0
    for path, status in (("/v1/files", 200), ("/health", 404), ("/v1/nothing", 404)):
        connection = batch_owner._UnixConnection(address["socket"])
        connection.request("GET", path)
        answer = connection.getresponse()
        assert answer.status == status and "json" in answer.getheader("Content-Type"), path
        connection.close()
    batch_owner._remove_socket(address)  # as the next owner would
