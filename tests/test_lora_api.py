"""LoRA adapters over HTTP, as vLLM serves them: loaded and unloaded while serving, listed by /v1/models,
picked by "model" on every generation endpoint and the Batch API; bad input is a 4xx that names it."""

import io
import json
import threading
import time

import pytest
from conftest import random_prompts, wait_until

NEW_TOKENS = 8


@pytest.fixture
def lora_app(make_app, lora_adapters, tmp_path):
    """An app started with LORA_MODULES=alpha=... and runtime loading from the adapters' directory, its test client."""
    app, manager = make_app(
        lora_modules=f"alpha={lora_adapters['alpha']}",
        data_dir=str(tmp_path / "data"),
        allow_runtime_lora_updating=True,
        lora_root=str(lora_adapters["alpha"].parent),
    )
    yield app, app.test_client()
    manager.shut_down(0)


def complete(client, model: str, prompt: list[int], **extra) -> tuple[int, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json={**body, **extra})
    return response.status_code, response.get_json()


def test_load_use_list_unload_then_404(lora_app, lora_adapters, peft_greedy):
    app, client = lora_app
    base = app.extensions["server"].engine.model_name
    for name in ("beta", "gamma"):
        response = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(lora_adapters[name])})
        assert response.status_code == 200 and f"'{name}' added" in response.text
    cards = {c["id"]: c for c in client.get("/v1/models").get_json()["data"]}
    assert list(cards) == [base, "alpha", "beta", "gamma"]
    assert cards["beta"]["parent"] == base and cards["beta"]["root"] == str(lora_adapters["beta"])
    assert cards[base]["parent"] is None

    (prompt,) = random_prompts([7], seed=50)
    for name in (base, "alpha", "beta", "gamma"):
        status, body = complete(client, name, prompt, return_token_ids=True)
        assert status == 200 and body["model"] == name
        (choice,) = body["choices"]
        oracle = peft_greedy(None if name == base else name, prompt, NEW_TOKENS)
        assert choice["token_ids"] == oracle and choice["prompt_token_ids"] == prompt

    streamed = client.post(
        "/v1/completions",
        json={"model": "alpha", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
              "stream": True, "return_token_ids": True},
    ).get_data(as_text=True)  # fmt: skip
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == peft_greedy("alpha", prompt, NEW_TOKENS)
    assert (
        chunks[0]["choices"][0]["prompt_token_ids"] == prompt and chunks[-1]["choices"][0]["prompt_token_ids"] is None
    )

    chat = {"model": "beta", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": NEW_TOKENS}
    body = client.post("/v1/chat/completions", json={**chat, "temperature": 0, "return_token_ids": True}).get_json()
    (choice,) = body["choices"]
    assert body["model"] == "beta" and choice["token_ids"]  # may end early, at the template's stop string
    expected = peft_greedy("beta", body["prompt_token_ids"], NEW_TOKENS)
    assert choice["token_ids"] == expected[: len(choice["token_ids"])]

    simple = {"prompt": "The lighthouse keeper", "num_tokens": NEW_TOKENS, "temperature": 0, "model": "gamma"}
    answer = client.post("/inference", json=simple).get_json()
    assert answer["token_ids"] == peft_greedy("gamma", [464, 46371, 28356], NEW_TOKENS)

    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"}).status_code == 200
    status, body = complete(client, "alpha", prompt)
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert client.post("/inference", json={**simple, "model": "alpha"}).status_code == 404
    assert "alpha" not in [c["id"] for c in client.get("/v1/models").get_json()["data"]]


@pytest.mark.parametrize(
    "route, body, status, param, words",
    [
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path", "'lora_path' must be"),
        ("/v1/load_lora_adapter", {"lora_path": "/tmp"}, 400, "lora_name", "'lora_name' must be"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere/at/all"}, 400, "lora_path", "cannot load"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}, 400, "lora_path", "cannot load"),
        ("/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": "ALPHA"}, 400, "lora_name", "already"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp", "extra": 1}, 400, "extra", "extra"),
        ("/v1/unload_lora_adapter", {"lora_name": "nobody"}, 404, "lora_name", "cannot be found"),
        ("/v1/unload_lora_adapter", {}, 400, "lora_name", "'lora_name' must be"),
    ],
)
def test_bad_input_is_a_4xx_naming_it_and_serving_goes_on(lora_app, lora_adapters, route, body, status, param, words):
    app, client = lora_app
    body = {k: str(lora_adapters["alpha"]) if v == "ALPHA" else v for k, v in body.items()}
    response = client.post(route, json=body)
    error = response.get_json()["error"]
    assert response.status_code == status and error["param"] == param and words in error["message"]
    assert complete(client, "alpha", [1, 2, 3])[0] == 200


def test_unload_is_refused_while_a_request_uses_the_adapter(lora_app):
    app, client = lora_app
    registry = app.extensions["server"].engine.loras
    adapter = registry.get("alpha")
    registry.hold(adapter)  # as the manager does from a request's acceptance to its answer
    response = client.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"})
    assert response.status_code == 409 and "in use by 1" in response.get_json()["error"]["message"]
    registry.release(adapter)
    assert complete(client, "alpha", [1, 2, 3])[0] == 200
    assert adapter.in_flight == 0  # the request held it and gave it back
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "alpha"}).status_code == 200


def test_batch_api_lines_pick_their_adapter(lora_app, peft_greedy):
    app, client = lora_app
    (prompt,) = random_prompts([5], seed=51)
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    line = lambda cid, b: {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": b}  # noqa: E731
    lines = [line("alpha", {**body, "model": "alpha"}), line("base", body)]
    text = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = {"purpose": "batch", "file": (io.BytesIO(text), "requests.jsonl")}
    file_id = client.post("/v1/files", data=upload, content_type="multipart/form-data").get_json()["id"]
    create = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    batch_id = client.post("/v1/batches", json=create).get_json()["id"]
    wait_until(lambda: client.get(f"/v1/batches/{batch_id}").get_json()["status"] == "completed", 120)
    output = client.get(f"/v1/batches/{batch_id}").get_json()["output_file_id"]
    records = [json.loads(line) for line in client.get(f"/v1/files/{output}/content").text.splitlines()]
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in records}
    tokenizer = app.extensions["server"].tokenizer
    assert texts == {
        "alpha": tokenizer.decode(peft_greedy("alpha", prompt, NEW_TOKENS)),
        "base": tokenizer.decode(peft_greedy(None, prompt, NEW_TOKENS)),
    }


def test_metrics_gauge_and_timeline_name_the_adapters(lora_app):
    app, client = lora_app
    manager = app.extensions["server"].manager
    running = threading.Thread(
        target=complete, args=(app.test_client(), "alpha", [1, 2, 3]), kwargs={"max_tokens": 100}
    )
    running.start()
    wait_until(lambda: manager.lora_names()[0] == ["alpha"])  # a 100-token request: seen while it runs
    assert 'running_lora_adapters="alpha"' in client.get("/metrics").text
    running.join()
    (info,) = [line for line in client.get("/metrics").text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    labels, value = info.rsplit(" ", 1)
    assert 'max_lora="4"' in labels and 'running_lora_adapters=""' in labels and 'waiting_lora_adapters=""' in labels
    assert abs(float(value) - time.time()) < 60  # vLLM's value: the time of the reading
    assert complete(client, app.extensions["server"].engine.model_name, [4, 5])[0] == 200
    events = client.get("/stats/timeline").get_json()["events"]
    assert {e["request"]: e["lora"] for e in events} == {events[0]["request"]: "alpha", events[-1]["request"]: None}
