"""The README's code, exactly as written there but for the server's address and the model: the first
request with curl and with the openai client against a real server, and the engine without the server;
each gets transformers' greedy continuation."""

import contextlib
import io
import json
import shutil
import subprocess

import pytest
from conftest import ROOT
from docs_blocks import block_with

from model.tokenizer import EOT_ID, load_tokenizer

README = ROOT / "README.md"
DEFAULT_URL = "http://127.0.0.1:8500"


@pytest.fixture(scope="module")
def expected_text(hf_greedy):
    """What the README's request asks for: 20 greedy tokens of its prompt, ending early at end-of-text."""
    tokenizer = load_tokenizer()
    tokens = hf_greedy(tokenizer.encode("The lighthouse keeper"), 20)
    if EOT_ID in tokens:
        tokens = tokens[: tokens.index(EOT_ID)]
    return tokenizer.decode(tokens)


def test_the_curl_request(url, expected_text):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed: apt-get install curl")
    command = block_with(README, "curl -s").replace(DEFAULT_URL, url)
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert answer["choices"][0]["text"] == expected_text


def test_the_openai_client_request(url, expected_text):
    code = block_with(README, "from openai import OpenAI").replace(DEFAULT_URL, url)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    assert printed.getvalue() == expected_text + "\n"


def test_the_engine_without_the_server(tiny_checkpoint, hf_greedy):
    code = block_with(README, "from generate.llm import").replace('"random:gpt2"', repr(str(tiny_checkpoint)))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    tokenizer = load_tokenizer()
    tokens = hf_greedy(tokenizer.encode("The lighthouse keeper"), 16)
    assert printed.getvalue() == f"{tokenizer.decode(tokens)} {tokens} length\n"
