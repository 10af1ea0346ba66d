"""Same seed, same tokens: a seeded request gets the same completion alone or in any batch, in every
mode, at any MAX_BATCH_TOKENS, from a cold or a warm prefix cache, after preemption, through every
endpoint. Real servers (./server.sh, gunicorn) on the tests' tiny checkpoint, sampled at temperatures
0.9 to 1.5: its spread-out weights give logits of magnitude ~10, whose last bits differ by ~1e-6
from one compute path to another, over broad distributions: the hard case. Inverse-CDF sampling,
which the server used before, parted from the reference at tokens 22, 42 and 56 of three of these
requests when they ran in a batch (with a checkpoint of nearly uniform, tiny logits it rarely did:
their roundings are smaller in absolute terms).

The reference is the nobatch server with no prefix cache and 13 tokens a step, each request alone;
the other servers compute the same logits along other paths (other chunks, batches, cached blocks,
recomputation after preemption), so their roundings differ, and their tokens must not.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest
import requests

from client.launch import running_server
from model.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer()
NUM_TOKENS = 60
PREFIX = "The lighthouse keeper climbed the winding stairs every evening, lit the lamp, and watched"


class Case(NamedTuple):
    prompt: str
    seed: int
    sampling: dict  # the fields /inference and /v1/completions share


CASES = [  # two share a prefix of more than a block, so the warm cache serves one from the other's blocks
    Case(PREFIX + " the ships", 3, {"temperature": 1.0}),
    Case(PREFIX + " the grey water below", 4, {"temperature": 1.0}),
    Case("Hello", 5, {"temperature": 1.5}),
    Case("Once upon a time in a small village", 6, {"temperature": 0.9, "top_p": 0.9}),
    Case("日本語と絵文字 🦙", 7, {"temperature": 1.0, "top_k": 500}),
    Case("日本語と絵文字 🦙", 3, {"temperature": 1.0}),  # inverse-CDF sampling parted at token 22 in a batch
    Case(PREFIX, 2**63 - 1, {"temperature": 1.2, "top_k": 2000, "top_p": 0.95}),
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where do the ships go?"}]


def serve(mode: str, checkpoint, tmp_path_factory, **settings: str):
    return running_server(mode, tmp_path_factory.mktemp(f"logs-{mode}"), MODEL=str(checkpoint), **settings)


def inference(url: str, case: Case) -> list[int]:
    body = {"prompt": case.prompt, "num_tokens": NUM_TOKENS, "seed": case.seed, **case.sampling}
    response = requests.post(f"{url}/inference", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["token_ids"]


def completion(url: str, case: Case, stream: bool, n: int = 1) -> list[str]:
    """/v1/completions' texts, one per choice; streamed: the events' pieces joined."""
    body = {"prompt": case.prompt, "max_tokens": NUM_TOKENS, "seed": case.seed, "ignore_eos": True, "n": n}
    body |= case.sampling | {"stream": stream}
    response = requests.post(f"{url}/v1/completions", json=body, stream=stream, timeout=120)
    assert response.status_code == 200, response.text
    if not stream:
        return [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]
    texts = [""] * n
    for line in response.iter_lines():
        if line and line != b"data: [DONE]":
            for choice in json.loads(line.removeprefix(b"data: "))["choices"]:
                texts[choice["index"]] += choice["text"]
    return texts


def chat(url: str, seed: int) -> str:
    body = {"messages": CHAT, "max_tokens": NUM_TOKENS, "seed": seed, "temperature": 1.0}
    response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


class Reference(NamedTuple):
    tokens: list[list[int]]  # each case's, alone
    chats: list[str]  # seeds 1 and 2, alone


def every_request(url: str) -> list:
    """All cases through every endpoint, and the chats, at once: one batch of everything."""
    calls = [lambda c=c: inference(url, c) for c in CASES]
    calls += [lambda c=c, s=s: completion(url, c, s)[0] for c in CASES for s in (False, True)]
    calls += [lambda s=s: chat(url, s) for s in (1, 2)]
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def check_against(reference: Reference, results: list) -> None:
    n = len(CASES)
    tokens, texts, chats = results[:n], results[n : 3 * n], results[3 * n :]
    assert tokens == reference.tokens
    assert texts == [TOKENIZER.decode(t) for t in reference.tokens for _ in (False, True)]
    assert chats == reference.chats


def metric(url: str, name: str) -> float:
    """A counter's value, over its labels, from /metrics (Prometheus text)."""
    samples = [line.split() for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines()]
    values = [float(s[-1]) for s in samples if s and s[0].split("{")[0] in (name, f"{name}_total")]
    assert values, f"no {name} in /metrics"
    return sum(values)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, tmp_path_factory) -> Reference:
    settings = {"PREFIX_CACHE": "off", "MAX_BATCH_TOKENS": "13", "KV_CACHE_BLOCKS": "512"}
    with serve("nobatch", tiny_checkpoint, tmp_path_factory, **settings) as url:
        ref = Reference([inference(url, c) for c in CASES], [chat(url, s) for s in (1, 2)])
        # sampled, not a greedy walk: every completion its own, over many tokens
        assert len({tuple(t) for t in ref.tokens}) == len(CASES) and ref.chats[0] != ref.chats[1]
        assert len({token for t in ref.tokens for token in t}) > len(CASES) * NUM_TOKENS // 2
        # the nobatch server's other endpoints, each request still alone
        assert [completion(url, c, stream=False)[0] for c in CASES] == [TOKENIZER.decode(t) for t in ref.tokens]
        assert [completion(url, c, stream=True)[0] for c in CASES] == [TOKENIZER.decode(t) for t in ref.tokens]
    return ref


def test_dynamic_alone_batched_and_from_a_warm_cache(tiny_checkpoint, tmp_path_factory, reference):
    with serve("dynamic", tiny_checkpoint, tmp_path_factory, KV_CACHE_BLOCKS="2048") as url:
        assert [inference(url, c) for c in CASES] == reference.tokens  # alone; the cache fills as they go
        hits = metric(url, "gpt2_prefix_cache_hit_tokens")
        for _ in range(2):  # everything at once, from a warm cache
            check_against(reference, every_request(url))
        assert metric(url, "gpt2_prefix_cache_hit_tokens") > hits
        # n completions with a seed: completion j is the request with seed + j
        two = completion(url, CASES[2], stream=False, n=2)
        assert two == [TOKENIZER.decode(inference(url, CASES[2]._replace(seed=CASES[2].seed + j))) for j in (0, 1)]


def test_static_with_a_tiny_pool_and_budget_preempts_and_keeps_the_tokens(tiny_checkpoint, tmp_path_factory, reference):
    # 32 blocks of 4 tokens, of which the longest request needs 22: requests are preempted and recomputed
    settings = {"KV_CACHE_BLOCKS": "32", "BLOCK_SIZE": "4", "MAX_BATCH_TOKENS": "7", "STATIC_BATCH_WAIT_S": "0.5"}
    with serve("static", tiny_checkpoint, tmp_path_factory, **settings) as url:
        check_against(reference, every_request(url))
        assert metric(url, "gpt2_preemptions") > 0
