"""Shared fixtures: a tiny GPT-2 checkpoint written by transformers, its greedy oracle, and an
in-process app serving it."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

if not torch.cuda.is_available():
    # The Triton kernel's tests run it on CPU tensors through Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The oracle is transformers in float32, so tests run in float32 unless they ask for another dtype: servers
# they start inherit DTYPE, and engines built in process get float32 as the CPU's default (which is
# bfloat16 on CPUs that compute it natively: test_server.py checks that choice).
os.environ.setdefault("DTYPE", "float32")

# The CPU attention kernel (ATTENTION_BACKEND=auto's choice on a CPU) is built once, here, into torch's extension
# cache, before any test or server it starts would each wait on the build.
from model import cpu_attention  # noqa: E402
from sim.profiles import write_fixed_step_profile  # noqa: E402

cpu_attention.available()


@pytest.fixture(autouse=True)
def float32_by_default(monkeypatch):
    monkeypatch.setattr("generate.engine.native_bfloat16", lambda: False)


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
def instrument_checkpoint(tmp_path_factory) -> Path:
    """benchmarks/train_instrument.py's tiny preset, 40 steps on the standard library's text (~15 s): a checkpoint
    whose distributions have learned the text's statistics, where a lossy mode's error shows."""
    out = tmp_path_factory.mktemp("instrument") / "tiny"
    command = [sys.executable, "-m", "benchmarks.train_instrument", "--out", str(out), "--preset", "tiny"]
    command += ["--steps", "40", "--batch", "4", "--train-tokens", "200000", "--lr", "3e-3"]
    subprocess.run(command, cwd=Path(__file__).parent.parent, check=True, timeout=600, capture_output=True)
    return out


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
            cache[key] = greedy_continuation(hf_model, prompt_ids, num_tokens)
        return cache[key]

    return run


def greedy_continuation(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """A transformers model's greedy continuation of one prompt, exactly num_tokens long."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        pad_token_id=50256,
    )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def hf_prompt_logprobs(hf_model):
    """transformers' log-probability of each prompt token after the first, and the `top` likeliest ids there."""

    def run(prompt: list[int], top: int = 1) -> tuple[list[float], list[list[int]]]:
        with torch.no_grad():
            logprobs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, :-1], dim=-1)
        chosen = logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
        return chosen.tolist(), logprobs.topk(top).indices.tolist()

    return run


def sim_settings(directory: Path, step_s: float) -> dict[str, str]:
    """ENGINE=sim settings whose every step takes `step_s`, whatever it computes (its FLOP/s and bandwidth
    are so high that the rest is about a microsecond): a server that is slow by the clock and costs no CPU."""
    profile = write_fixed_step_profile(directory, step_s)
    # DTYPE unset: the simulated model's own (16-bit), not the float32 the real engine's tests run in
    return {"ENGINE": "sim", "SIM_MODEL": "gpt2", "SIM_GPU": str(profile), "DTYPE": ""}


def random_prompts(lengths: list[int], seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(0, 50257, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="session")
def url(tiny_checkpoint, tmp_path_factory):
    """One real server (./server.sh, gunicorn) on the tiny checkpoint, for the API tests that share it;
    modules that need other settings define a `url` of their own."""
    from client.launch import running_server

    settings = {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "4096"}
    with running_server("dynamic", tmp_path_factory.mktemp("logs"), **settings) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    """The official openai client on the module's server (its `url` fixture)."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    (served,) = client.models.list().data
    return served.id


@pytest.fixture
def make_app(tiny_checkpoint):
    """An app (Flask test client's side of the server) over the tiny checkpoint, and its batching manager (in this
    process: real servers, tests through HTTP, run the engine's process)."""
    from app import create_app
    from config import Settings

    def make(**settings):
        settings.setdefault("kv_cache_blocks", 256)
        settings.setdefault("engine_process", "off")  # the engine in this process: a test may reach into it
        app = create_app(Settings.of(model=str(tiny_checkpoint), **settings))
        return app, app.extensions["server"].manager

    return make


def wait_until(condition, deadline_s: float = 30) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.01)  # polling interval under a deadline


# LoRA adapters of the tiny checkpoint, saved by peft: (name, LoraConfig arguments). Each has its own rank,
# targets and scaling (plain, rsLoRA, a per-module alpha), so a mix-up between them changes tokens.
LORA_CONFIGS = {
    "alpha": dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"]),
    "beta": dict(r=8, lora_alpha=16, target_modules=["c_attn"], layers_to_transform=[1], use_rslora=True),
    "gamma": dict(r=2, lora_alpha=4, target_modules=r".*\.mlp\.c_(fc|proj)", alpha_pattern={"c_fc": 2}),
}


def save_lora(checkpoint: Path, directory: Path, seed: int, **config) -> Path:
    """A peft adapter of `checkpoint` with random A and B (peft starts B at zero: no effect at all)."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    model = get_peft_model(GPT2LMHeadModel.from_pretrained(checkpoint), LoraConfig(fan_in_fan_out=True, **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def lora_adapters(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """name -> directory of each LORA_CONFIGS adapter."""
    root = tmp_path_factory.mktemp("loras")
    return {name: save_lora(tiny_checkpoint, root / name, i, **c) for i, (name, c) in enumerate(LORA_CONFIGS.items())}


@pytest.fixture(scope="session")
def peft_greedy(tiny_checkpoint, lora_adapters, hf_greedy):
    """Greedy continuation through an adapter (None: the base) by peft's merge_and_unload() model in transformers."""
    from peft import PeftModel
    from transformers import GPT2LMHeadModel

    models, cache = {}, {}

    def run(adapter: str | None, prompt_ids: list[int], num_tokens: int) -> list[int]:
        if adapter is None:
            return hf_greedy(prompt_ids, num_tokens)
        if adapter not in models:
            base = GPT2LMHeadModel.from_pretrained(tiny_checkpoint)
            models[adapter] = PeftModel.from_pretrained(base, lora_adapters[adapter]).merge_and_unload().eval()
        key = (adapter, tuple(prompt_ids), num_tokens)
        if key not in cache:
            cache[key] = greedy_continuation(models[adapter], prompt_ids, num_tokens)
        return cache[key]

    return run
