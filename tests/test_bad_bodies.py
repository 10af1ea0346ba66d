"""Malformed request bodies, as raw bytes, on every POST endpoint: a JSON 4xx that names the problem, never a 5xx."""

import json

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.batches import non_json_post
from app import create_app
from client.launch import running_server
from config import Settings

MAX_BODY_BYTES = 1 << 20


@pytest.fixture(scope="module")
def url(tiny_checkpoint, tmp_path_factory):
    env = {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "512", "MAX_BODY_BYTES": str(MAX_BODY_BYTES)}
    with running_server("dynamic", tmp_path_factory.mktemp("logs"), **env) as url:
        yield url


@pytest.fixture(scope="module")
def post_endpoints(tiny_checkpoint) -> list[str]:
    """Every POST route the app has, so a new endpoint is covered without editing this file."""
    app = create_app(Settings.of(model=str(tiny_checkpoint), kv_cache_blocks=16))
    posts = [rule.rule for rule in app.url_map.iter_rules() if "POST" in rule.methods]
    paths = sorted(path for path in posts if not non_json_post(path))  # an upload (multipart) and a cancel
    app.extensions["server"].manager.shut_down(0)
    assert "/inference" in paths and "/v1/completions" in paths
    return paths


def send(url: str, path: str, body: bytes, content_type: str | None = "application/json") -> requests.Response:
    headers = {"Content-Type": content_type} if content_type else {}
    return requests.post(f"{url}{path}", data=body, headers=headers, timeout=60)


def assert_json_4xx(response: requests.Response, *fragments: str, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error


CASES = [
    ("[" * 100_000 + "]" * 100_000, ("nested too deeply",)),
    ('{"a":' * 100_000 + "1" + "}" * 100_000, ("nested too deeply",)),
    (b'{"prompt": "caf\xe9", "num_tokens": 2, "max_tokens": 2}', ("not valid UTF-8", "byte 15")),
    (b"\xff\xfe{\x00}\x00", ("not valid UTF-8",)),
    ('{"prompt": "hi", "prompt": "again", "num_tokens": 2, "max_tokens": 2}', ("duplicate key 'prompt'",)),
    ('{"prompt": "hi", "num_tokens": ' + "9" * 5000 + "}", ("out of range",)),
    ('{"prompt": "hi", "num_tokens": 2', ("not valid JSON", "line 1")),
    ("", ("not valid JSON",)),
    ("prompt=hi&num_tokens=2", ("not valid JSON",)),
    ("null", ("JSON object",)),
]


@pytest.mark.parametrize(("body", "fragments"), CASES)
def test_malformed_bodies_get_a_400_that_says_why_on_every_endpoint(url, post_endpoints, body, fragments):
    raw = body.encode() if isinstance(body, str) else body
    for path in post_endpoints:
        assert_json_4xx(send(url, path, raw), *fragments)


# Each endpoint refuses fields it does not know, so a number's own check is reached with that endpoint's fields.
SAMPLING_BODIES = {
    "/inference": '{"prompt": "hi", "num_tokens": 2, "temperature": %s}',
    "/v1/completions": '{"prompt": "hi", "max_tokens": 2, "temperature": %s}',
    "/v1/chat/completions": '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": %s}',
}


@pytest.mark.parametrize(
    ("number", "fragments"), [("1e999", ("'temperature'", "inf")), ("-Infinity", ("'temperature'",))]
)
def test_infinite_numbers_are_refused_by_their_field(url, post_endpoints, number, fragments):
    assert set(SAMPLING_BODIES) <= set(post_endpoints)
    for path, body in SAMPLING_BODIES.items():
        error = assert_json_4xx(send(url, path, (body % number).encode()), *fragments)
        assert error["param"] == "temperature"


def test_a_duplicate_key_is_named_as_the_param(url):
    error = assert_json_4xx(send(url, "/inference", b'{"prompt": "a", "num_tokens": 1, "num_tokens": 2}'))
    assert error["param"] == "num_tokens"


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_a_content_type_that_is_not_json_gets_415_naming_it(url, post_endpoints, content_type):
    body = json.dumps({"prompt": "hi", "num_tokens": 2, "max_tokens": 2}).encode()
    for path in post_endpoints:
        error = assert_json_4xx(send(url, path, body, content_type), "Content-Type: application/json", status=415)
        assert error["param"] == "Content-Type"


def test_a_json_content_type_with_charset_is_fine_and_the_server_keeps_serving(url):
    body = json.dumps({"prompt": "hi", "num_tokens": 2}).encode()
    response = send(url, "/inference", body, "application/json; charset=utf-8")
    assert response.status_code == 200 and response.json()["completion_tokens"] == 2


def test_a_body_just_under_the_limit_is_parsed_and_one_over_is_413(url):
    filler = " " * (MAX_BODY_BYTES - 200)
    under = ('{"prompt": "hi",' + filler + '"num_tokens": "two"}').encode()
    assert len(under) < MAX_BODY_BYTES
    assert_json_4xx(send(url, "/inference", under), "'num_tokens'")
    over = ('{"prompt": "hi",' + " " * MAX_BODY_BYTES + '"num_tokens": 2}').encode()
    assert_json_4xx(send(url, "/inference", over), status=413)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    body=st.binary(max_size=300)
    | st.text(max_size=200).map(str.encode)
    | st.sampled_from([b"{", b"[", b'{"prompt"', b'{"prompt": "hi", "num_tokens": 1}']).flatmap(
        lambda head: st.binary(max_size=60).map(lambda tail: head + tail)
    ),
    content_type=st.sampled_from(["application/json", None, "text/plain", "application/json; charset=latin-1"]),
    index=st.integers(0, 100),
)
def test_random_bytes_get_a_json_4xx_or_a_completion(url, post_endpoints, body, content_type, index):
    response = send(url, post_endpoints[index % len(post_endpoints)], body, content_type)
    assert response.status_code < 500, response.text
    payload = response.json()
    assert response.status_code == 200 or payload["error"]["message"]


def test_still_serving_after_the_bytes(url):
    response = requests.post(f"{url}/inference", json={"prompt": "hello", "num_tokens": 3}, timeout=60)
    assert response.status_code == 200 and response.json()["completion_tokens"] == 3
