"""OpenAI's Batch API through the official client against a real server: upload, create, poll, download;
outputs equal the same requests sent one by one; bad lines go to the error file; a batch survives a
server killed mid-batch with nothing lost or run twice; cancel stops it."""

import io
import json
import os
import signal
import time

import openai
import pytest

from client.launch import start_server, stop_server

DEADLINE_S = 300


@pytest.fixture
def server(tiny_checkpoint, tmp_path):
    """A server factory over one DATA_DIR: a restarted server finds the batches of the one before."""
    procs = []
    settings = {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "2048", "DATA_DIR": str(tmp_path / "data")}

    def start(port: int | None = None, **more: str) -> tuple[object, openai.OpenAI]:
        proc, url = start_server("dynamic", tmp_path, port=port, **settings, **more)
        procs.append(proc)
        return proc, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    yield start
    for proc in procs:
        if proc.poll() is None:
            stop_server(proc)


def upload(client: openai.OpenAI, lines: list) -> str:
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"
    return client.files.create(file=("requests.jsonl", io.BytesIO(text.encode())), purpose="batch").id


def request(custom_id: str, body: dict, url: str = "/v1/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def poll(client: openai.OpenAI, batch_id: str, until, deadline_s: float = DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while not until(batch := client.batches.retrieve(batch_id)):
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)  # polling interval under a deadline
    return batch


def records(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()] if file_id else []


def completion_body(i: int, max_tokens: int = 8) -> dict:
    return {"prompt": f"Request number {i} says", "max_tokens": max_tokens, "temperature": 0}


def test_a_batch_runs_to_completion_and_equals_the_requests_sent_one_by_one(server):
    _, client = server()
    good = {f"req-{i}": completion_body(i) for i in range(6)}
    lines = [request(cid, body) for cid, body in good.items()]
    lines += [
        "{not json",
        request("bad-field", {"prompt": "x", "max_tokens": 2, "tempreature": 0}),  # the endpoint's 400
        request("req-0", completion_body(99)),  # a custom_id used twice
        request("wrong-url", completion_body(1), url="/v1/embeddings"),
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/completions", completion_window="24h"
    )
    assert batch.status in ("validating", "in_progress") and batch.request_counts.total == 10
    done = poll(client, batch.id, lambda b: b.status == "completed")
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 4)
    out = {r["custom_id"]: r for r in records(client, done.output_file_id)}
    assert set(out) == set(good) and all(r["response"]["status_code"] == 200 for r in out.values())
    for cid, body in good.items():
        alone = client.completions.create(model=out[cid]["response"]["body"]["model"], **body)
        assert out[cid]["response"]["body"]["choices"][0]["text"] == alone.choices[0].text
    errors = records(client, done.error_file_id)
    assert sorted(str(e["custom_id"]) for e in errors) == ["None", "bad-field", "req-0", "wrong-url"]
    by_id = {e["custom_id"]: e for e in errors}
    assert by_id["bad-field"]["response"]["status_code"] == 400
    assert "tempreature" in by_id["bad-field"]["response"]["body"]["error"]["message"]
    assert "already used by line 1" in by_id["req-0"]["error"]["message"]
    assert client.files.retrieve(done.output_file_id).bytes > 0


def test_a_chat_batch_and_bad_requests_to_the_api(server):
    _, client = server()
    bodies = [
        {"messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 5, "temperature": 0} for i in range(3)
    ]
    lines = [request(f"c{i}", b, url="/v1/chat/completions") for i, b in enumerate(bodies)]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = poll(client, batch.id, lambda b: b.status == "completed")
    out = {r["custom_id"]: r["response"]["body"] for r in records(client, done.output_file_id)}
    for i, body in enumerate(bodies):
        alone = client.chat.completions.create(model=out[f"c{i}"]["model"], **body)
        assert out[f"c{i}"]["choices"][0]["message"]["content"] == alone.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/completions", completion_window="1h")
    with pytest.raises(openai.NotFoundError, match="file-nope"):  # as another key's file would be
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        client.batches.create(input_file_id=done.output_file_id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")


def start_batch(client: openai.OpenAI, count: int) -> tuple[dict[str, dict], object]:
    """A completions batch of `count` 40-token requests: their bodies by custom_id, and the batch."""
    bodies = {f"r{i}": completion_body(i, max_tokens=40) for i in range(count)}
    file_id = upload(client, [request(cid, body) for cid, body in bodies.items()])
    return bodies, client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")


def test_a_batch_survives_a_server_killed_mid_batch_with_nothing_lost_or_run_twice(server):
    proc, client = server(BATCH_IN_FLIGHT="2")
    bodies, batch = start_batch(client, 24)
    poll(client, batch.id, lambda b: b.request_counts.completed >= 3)
    port = int(str(client.base_url).rsplit(":", 1)[1].split("/")[0])
    os.killpg(proc.pid, signal.SIGKILL)  # no goodbye: requests in flight are simply gone
    proc.wait()
    _, client = server(port=port, BATCH_IN_FLIGHT="2")
    done = poll(client, batch.id, lambda b: b.status == "completed")
    out = records(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(bodies) and not records(client, done.error_file_id)
    assert done.request_counts.completed == 24 and done.request_counts.failed == 0
    for r in out[:6]:
        alone = client.completions.create(model=r["response"]["body"]["model"], **bodies[r["custom_id"]])
        assert r["response"]["body"]["choices"][0]["text"] == alone.choices[0].text


def test_cancel_stops_a_batch_and_keeps_what_it_finished(server):
    _, client = server(BATCH_IN_FLIGHT="1")
    _, batch = start_batch(client, 60)
    poll(client, batch.id, lambda b: b.request_counts.completed >= 1)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = poll(client, batch.id, lambda b: b.status == "cancelled")
    assert done.cancelled_at and done.request_counts.completed < 60
    out = records(client, done.output_file_id)
    assert len(out) == done.request_counts.completed == len({r["custom_id"] for r in out})


def test_upload_limits_are_the_batch_settings_not_the_request_body_limit(make_app, tmp_path):
    app, manager = make_app(data_dir=str(tmp_path), batch_max_file_bytes=2 << 20, batch_max_requests=3)
    client = app.test_client()

    def post(text: str):
        files = {"purpose": "batch", "file": (io.BytesIO(text.encode()), "requests.jsonl")}
        return client.post("/v1/files", data=files, content_type="multipart/form-data")

    line = json.dumps(request("x", completion_body(0)))
    big = post(line + " " * 1_500_000 + "\n")  # over MAX_BODY_BYTES (1 MiB), under BATCH_MAX_FILE_BYTES
    assert big.status_code == 200 and big.get_json()["bytes"] > 1_500_000
    too_big = post(line + " " * (2 << 20) + "\n")
    assert too_big.status_code == 413 and too_big.get_json()["error"]["param"] in ("file", None)
    too_many = post("\n".join([line] * 4))
    assert too_many.status_code == 400 and too_many.get_json()["error"]["param"] == "file"
    manager.shut_down(0)
