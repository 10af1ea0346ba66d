"""Shared fixtures: a tiny GPT-2 checkpoint written by transformers, its greedy oracle, and an
in-process app serving it."""

import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Spread-out random weights, so greedy continuations vary token to token and any error
# in positions or cached keys/values changes the output (GPT-2's 0.02 gives one token repeated).
TINY = dict(n_layer=2, n_head=4, n_embd=64, n_positions=1024, initializer_range=0.5)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1234)
    directory = tmp_path_factory.mktemp("tiny-gpt2")
    GPT2LMHeadModel(GPT2Config(**TINY)).eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(tiny_checkpoint).eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """transformers' greedy continuation of one prompt, alone, as the reference."""
    cache: dict[tuple, list[int]] = {}

    def run(prompt_ids: list[int], num_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), num_tokens)
        if key not in cache:
            ids = torch.tensor([prompt_ids])
            out = hf_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                do_sample=False,
                pad_token_id=50256,
            )
            cache[key] = out[0, len(prompt_ids) :].tolist()
        return cache[key]

    return run


def random_prompts(lengths: list[int], seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(0, 50257, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture
def make_app(tiny_checkpoint):
    """An app (Flask test client's side of the server) over the tiny checkpoint, and its batching manager."""
    from app import create_app
    from config import Settings

    def make(**settings):
        settings.setdefault("kv_cache_blocks", 256)
        app = create_app(Settings(model=str(tiny_checkpoint), **settings))
        return app, app.extensions["server"].manager

    return make


def wait_until(condition, deadline_s: float = 30) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.01)  # polling interval under a deadline
