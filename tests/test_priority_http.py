"""Priorities through HTTP on a real server: an urgent request preempts a running batch and the outputs
stay greedy; a bad priority is a 400 naming the field."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from conftest import random_prompts, wait_until

from client.launch import running_server
from model.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer()


@pytest.fixture(scope="module")
def url(tiny_checkpoint, tmp_path_factory):
    settings = {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "4096", "MAX_BATCH_SIZE": "4"}
    with running_server("dynamic", tmp_path_factory.mktemp("logs"), **settings) as url:
        yield url


def infer(url: str, prompt: str, num_tokens: int, priority: int | None = None) -> dict:
    body = {"prompt": prompt, "num_tokens": num_tokens, "temperature": 0}
    if priority is not None:
        body["priority"] = priority
    response = requests.post(f"{url}/inference", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def texts(seed: int, count: int) -> list[str]:
    """Prompts whose text encodes back to the same tokens (decoded random ids may not)."""
    return [TOKENIZER.decode(TOKENIZER.encode(TOKENIZER.decode(p))) for p in random_prompts([10] * count, seed=seed)]


def test_an_urgent_request_preempts_a_running_batch_over_http(url, hf_greedy):
    stats = lambda: requests.get(f"{url}/stats", timeout=10).json()
    low_prompts, (urgent_prompt,) = texts(50, 4), texts(51, 1)
    with ThreadPoolExecutor(4) as pool:
        batch = [pool.submit(infer, url, p, 300, 5) for p in low_prompts]  # fills all 4 seats for a while
        wait_until(lambda: stats()["requests_running"] == 4 and stats()["requests_completed"] == 0, 60)
        wait_until(lambda: stats()["steps"] > 5, 60)
        urgent = infer(url, urgent_prompt, 8, 0)
        assert not any(f.done() for f in batch)  # it did not wait for a seat to come free
        answers = [f.result(timeout=300) for f in batch]
    assert stats()["preemptions"] >= 1
    for prompt, answer in zip([*low_prompts, urgent_prompt], [*answers, urgent]):
        assert answer["token_ids"] == hf_greedy(TOKENIZER.encode(prompt), len(answer["token_ids"]))
    assert urgent["completion_tokens"] == 8 and all(a["completion_tokens"] == 300 for a in answers)
    final = stats()
    assert final["kv_cache_integrity"] == "ok" and final["kv_blocks_used"] == 0 and final["requests_failed"] == 0


@pytest.mark.parametrize("endpoint", ["/inference", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("priority", ["high", 1.5, True, 1001, -1001])
def test_a_bad_priority_is_a_400_naming_it(url, endpoint, priority):
    body = {"prompt": "hi", "num_tokens": 1} if endpoint == "/inference" else {"max_tokens": 1}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in endpoint else {"prompt": "hi"}
    response = requests.post(f"{url}{endpoint}", json={**body, "priority": priority}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority", response.text


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_priority_is_accepted_by_the_openai_endpoints(client, model, endpoint):
    if "chat" in endpoint:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_body={"priority": -3}
        )
    else:
        reply = client.completions.create(model=model, prompt="hi", max_tokens=3, extra_body={"priority": -3})
    assert reply.usage.completion_tokens == 3
