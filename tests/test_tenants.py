"""Tenants over HTTP: the keys file (hashed keys, weights, limits), a key's tenant, the `user` field, the
single API_KEY beside the file, the Batch API's creator, per-tenant limits refused with 429, and the
per-tenant figures in /stats and /metrics."""

import hashlib
import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import sim_settings, wait_until
from test_admission import metric

from api.tenants import KeyRing

ALICE_HASH = hashlib.sha256(b"alice-key").hexdigest()
KEYS = f"""
[tenants.alice]
keys = ["sha256:{ALICE_HASH}"]
weight = 2
max_waiting = 2

[tenants.bob]
keys = ["bob-plain-key"]
max_running = 1

[tenants.ops]
keys = ["ops-key"]
admin = true
"""


def keys_file(tmp_path, text: str = KEYS, name: str = "keys.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_keys_file_keeps_hashes_only_and_gives_each_key_its_tenant(tmp_path):
    ring = KeyRing.load(keys_file(tmp_path))
    assert ring.tenant("alice-key").name == "alice" and ring.tenant("alice-key").weight == 2
    assert ring.tenant("bob-plain-key").max_running == 1 and ring.tenant("nobody") is None
    assert "bob-plain-key" not in repr(vars(ring))
    as_json = {"tenants": {"carol": {"keys": ["carol-key"], "max_waiting": 3}}}
    assert KeyRing.load(keys_file(tmp_path, json.dumps(as_json), "keys.json")).tenant("carol-key").max_waiting == 3


@pytest.mark.parametrize(
    "text, problem",
    [
        ('[tenants.a]\nkeys = ["k1"]\nweight = 0', "'weight'"),
        ('[tenants.a]\nkeys = ["secret-k"]\n[tenants.b]\nkeys = ["secret-k"]', "share a key"),
        ('[tenants.a]\nkeys = ["secret-k"]\ncolour = 1', "unknown field 'colour'"),
        ('[tenants.a]\nkeys = ["sha256:abc"]', "64 hex digits"),
        ('[tenants.a]\nkeys = ["secret-k"]\nmax_running = 0', "'max_running'"),
        ('[tenants.a]\nkeys = ["secret-k"]\nadmin = "yes"', "'admin'"),
        ('[tenants.a]\nkeys = ["secret-k"]\nmin_priority = -1001', "'min_priority'"),
        ("tenants = 3", "'tenants' table"),
    ],
)
def test_a_bad_keys_file_stops_the_server_naming_the_problem_never_a_key(tmp_path, text, problem):
    with pytest.raises(ValueError) as err:
        KeyRing.load(keys_file(tmp_path, text))
    assert problem in str(err.value) and "secret-k" not in str(err.value)


def tenant_app(make_app, tmp_path, **settings):
    sim = {k.lower(): v for k, v in sim_settings(tmp_path, 0.01).items()}
    app, manager = make_app(api_keys_file=keys_file(tmp_path), api_key="master", **sim, **settings)
    return app.test_client(), manager


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_requests_count_for_their_keys_tenant_else_their_user_and_other_keys_are_refused(make_app, tmp_path):
    client, _ = tenant_app(make_app, tmp_path)
    body = {"prompt": "hello there", "max_tokens": 3}
    assert client.post("/v1/completions", json=body, headers=bearer("alice-key")).status_code == 200
    # a key's tenant wins over the user field; the master key lets the user field name the tenant
    assert (
        client.post("/v1/completions", json={**body, "user": "x"}, headers=bearer("bob-plain-key")).status_code == 200
    )
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "user": "dave"}
    assert client.post("/v1/chat/completions", json=chat, headers=bearer("master")).status_code == 200
    inference = {"prompt": "hi", "num_tokens": 5}
    assert client.post("/inference", json=inference, headers=bearer("master")).status_code == 200
    refused = client.post("/v1/completions", json=body, headers=bearer("alice-key-wrong"))
    assert refused.status_code == 401 and refused.get_json()["error"]["type"] == "authentication_error"
    bad_user = client.post("/inference", json={**inference, "user": 5}, headers=bearer("master"))
    assert bad_user.status_code == 400 and bad_user.get_json()["error"]["param"] == "user"
    stats = client.get("/stats", headers=bearer("ops-key")).get_json()  # the operator sees every tenant
    assert stats["tenant_generated_tokens"] == {"alice": 3, "bob": 3, "dave": 4, "shared": 5}
    text = client.get("/metrics", headers=bearer("ops-key")).get_data(as_text=True)
    assert metric(text, "gpt2_tenant_generated_tokens_total", tenant="dave") == 4


def test_a_tenant_past_its_limits_gets_429_with_retry_after_counted_by_reason_and_tenant(make_app, tmp_path):
    client, manager = tenant_app(make_app, tmp_path)
    gate, step = threading.Event(), manager.engine.step
    manager.engine.step = lambda: gate.wait() and step()
    body = {"prompt": "hi", "num_tokens": 2}
    with ThreadPoolExecutor(4) as pool:
        try:
            held = []
            for key in ["alice-key", "alice-key", "bob-plain-key"]:
                held.append(pool.submit(client.post, "/inference", json=body, headers=bearer(key)))
                wait_until(lambda: manager.num_waiting() == len(held))
            alice_third = client.post("/inference", json=body, headers=bearer("alice-key"))
        finally:
            gate.set()
        assert [f.result(timeout=60).status_code for f in held] == [200, 200, 200]
        gate.clear()  # one of bob's running, held in its second step: his next one is refused
        after = manager.engine.num_steps + 1
        manager.engine.step = lambda: (manager.engine.num_steps < after or gate.wait()) and step()
        first = pool.submit(client.post, "/inference", json={**body, "num_tokens": 50}, headers=bearer("bob-plain-key"))
        wait_until(lambda: manager.admission.tenants._running["bob"] == 1)
        bob_second = client.post("/inference", json=body, headers=bearer("bob-plain-key"))
        gate.set()
        assert first.result(timeout=60).status_code == 200
    for response, reason in [(alice_third, "waiting"), (bob_second, "running")]:
        assert response.status_code == 429 and response.headers["Retry-After"] == "1"
        assert (
            response.get_json()["error"]["type"] == "overloaded" and reason in response.get_json()["error"]["message"]
        )
    stats = client.get("/stats", headers=bearer("ops-key")).get_json()
    assert stats["requests_refused"]["tenant_max_waiting"] == 1 and stats["requests_refused"]["tenant_max_running"] == 1
    assert stats["tenant_requests_refused"] == {"alice": 1, "bob": 1}


def test_a_batchs_requests_count_for_the_tenant_that_created_it(make_app, tmp_path):
    client, _ = tenant_app(make_app, tmp_path, data_dir=str(tmp_path / "data"))
    line = {"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 6}}
    upload = {"purpose": "batch", "file": (io.BytesIO(json.dumps(line).encode()), "requests.jsonl")}
    file_id = client.post("/v1/files", data=upload, headers=bearer("bob-plain-key")).get_json()["id"]
    batch = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    created = client.post("/v1/batches", json=batch, headers=bearer("bob-plain-key")).get_json()
    assert "tenant" not in created
    done = lambda: client.get(f"/v1/batches/{created['id']}", headers=bearer("bob-plain-key")).get_json()  # noqa: E731
    wait_until(lambda: done()["status"] == "completed", 60)
    assert done()["request_counts"]["completed"] == 1
    stats = client.get("/stats", headers=bearer("ops-key")).get_json()
    assert stats["tenant_generated_tokens"] == {"bob": 6}
