"""/v1/completions through the official openai package, against the real gunicorn server."""

import contextlib
import json
import time

import openai
import pytest
import requests
import torch

from client.launch import running_server
from model.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer()
PROMPT = "The lighthouse keeper climbed the stairs and"


@pytest.fixture(scope="module")
def url(tiny_checkpoint, tmp_path_factory):
    settings = {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "4096"}
    with running_server("dynamic", tmp_path_factory.mktemp("logs"), **settings) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    (served,) = client.models.list().data
    return served.id


def complete(client, model, **kwargs):
    kwargs.setdefault("extra_body", {})["ignore_eos"] = True  # compare whole lengths
    return client.completions.create(model=model, **kwargs)


def test_greedy_completion_equals_transformers(client, model, hf_greedy):
    result = complete(client, model, prompt=PROMPT, max_tokens=30, temperature=0)
    expected = TOKENIZER.decode(hf_greedy(TOKENIZER.encode(PROMPT), 30))
    (choice,) = result.choices
    assert choice.text == expected and choice.finish_reason == "length"
    assert result.object == "text_completion" and result.model == model
    n = len(TOKENIZER.encode(PROMPT))
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (n, 30, n + 30)


def test_logprobs_equal_transformers_log_softmax(client, model, hf_model, hf_greedy):
    prompt_ids = TOKENIZER.encode(PROMPT)
    result = complete(client, model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2)
    logprobs = result.choices[0].logprobs
    generated = hf_greedy(prompt_ids, 10)
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([prompt_ids + generated])).logits[0], dim=-1)
    expected = [reference[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(generated)]
    assert logprobs.token_logprobs == pytest.approx(expected, abs=1e-3)
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[1] == len(logprobs.tokens[0])
    for top, chosen in zip(logprobs.top_logprobs, logprobs.token_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(chosen)  # greedy takes the likeliest


def test_token_id_prompt_equals_text_prompt(client, model):
    by_text = complete(client, model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    by_ids = complete(client, model, prompt=TOKENIZER.encode(PROMPT), max_tokens=12, temperature=0).choices[0].text
    assert by_ids == by_text


def test_stream_joins_to_the_same_text(client, model):
    args = dict(prompt=PROMPT, max_tokens=40, temperature=0.9, seed=11)
    whole = complete(client, model, **args).choices[0].text
    chunks = list(complete(client, model, stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_stream_ends_with_usage_when_asked(client, model):
    chunks = list(
        complete(client, model, prompt=PROMPT, max_tokens=17, stream=True, stream_options={"include_usage": True})
    )
    *text_chunks, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 17
    n = len(TOKENIZER.encode(PROMPT))
    assert (last.usage.prompt_tokens, last.usage.total_tokens) == (n, n + 17)
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in text_chunks)


def test_streamed_events_join_to_the_decoded_tokens(url):
    settings = {"temperature": 1.0, "seed": 3}
    prompt = "日本語と絵文字 🦙"
    ids = requests.post(f"{url}/inference", json={"prompt": prompt, "num_tokens": 60, **settings}, timeout=60)
    body = {"prompt": prompt, "max_tokens": 60, "stream": True, "ignore_eos": True, **settings}
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == b"data: [DONE]"
    pieces = [json.loads(e.removeprefix(b"data: "))["choices"][0]["text"] for e in events[:-1]]
    assert "".join(pieces) == TOKENIZER.decode(ids.json()["token_ids"])


def test_stop_string_ends_the_text_before_it(client, model):
    full = complete(client, model, prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    stop = full[15:19]
    result = complete(client, model, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "never appears"])
    assert result.choices[0].text == full[: full.index(stop)]
    assert result.choices[0].finish_reason == "stop"
    streamed = complete(client, model, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]


def test_seeded_sampling_is_reproducible(client, model):
    args = dict(prompt=PROMPT, max_tokens=25, temperature=1.0, top_p=0.95)
    a, b, c = (complete(client, model, seed=s, **args).choices[0].text for s in (1, 1, 2))
    assert a == b != c


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"max_tokens": 1020}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),  # without echo
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": "yes"}, "echo"),
        ({"suffix": "the end"}, "suffix"),
        ({"logit_bias": {"50257": 1}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": "high"}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_tokens": 20}, "max_tokens": 10}, "min_tokens"),
        ({"extra_body": {"top_k": -2}}, "top_k"),
        ({"extra_body": {"ignore_eos": 1}}, "ignore_eos"),
        ({"extra_body": {"guided_json": {}}}, "guided_json"),
        ({"user": 5}, "user"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without streaming
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"stream": True, "stream_options": {"other": True}}, "stream_options"),
    ],
)
def test_bad_requests_raise_bad_request_error(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=PROMPT, **kwargs)
    assert caught.value.body["param"] == param


def test_wrong_model_and_empty_prompt_are_refused(client, model):
    with pytest.raises(openai.BadRequestError, match="served model"):
        client.completions.create(model="gpt-4", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="'prompt'"):
        client.completions.create(model=model, prompt="")


def test_too_long_names_both_numbers(client, model):
    with pytest.raises(openai.BadRequestError, match=r"prompt \(\d+ tokens\) \+ max tokens \(1000\) = \d+ exceeds"):
        client.completions.create(model=model, prompt=PROMPT * 10, max_tokens=1000)


def test_clients_that_hang_up_mid_stream_free_their_blocks(url):
    body = {"prompt": PROMPT, "max_tokens": 500, "stream": True, "ignore_eos": True}
    before = wait_for_idle(url)
    for _ in range(100):
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as response:
            next(response.iter_lines())  # the first event, then hang up
    stats = wait_for_idle(url)
    assert stats["kv_blocks_used"] == 0 and stats["kv_cache_integrity"] == "ok"
    assert stats["requests_failed"] - before["requests_failed"] == 100  # cancelled, not run to the end
    assert stats["requests_completed"] == before["requests_completed"]
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def wait_for_idle(url: str, deadline_s: float = 60) -> dict:
    deadline = time.monotonic() + deadline_s
    while True:
        stats = requests.get(f"{url}/stats", timeout=10).json()
        idle = stats["requests_running"] == stats["requests_waiting"] == stats["kv_blocks_used"] == 0
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)  # polling interval under a deadline


def test_api_key_guards_everything_but_health(tiny_checkpoint, tmp_path):
    settings = {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "256", "API_KEY": "s3cret"}
    with running_server("dynamic", tmp_path, **settings) as url:
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        for path in ("/stats", "/v1/models"):
            assert requests.get(f"{url}{path}", timeout=10).status_code == 401
        wrong = requests.get(f"{url}/stats", headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        with contextlib.closing(openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)) as good:
            assert good.completions.create(model=good.models.list().data[0].id, prompt="hi", max_tokens=2).choices
