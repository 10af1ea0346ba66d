"""KV_CACHE_DTYPE: keys and values in 8 bits with a scale per token and head. Its quality on a model that has learned
the text (benchmarks/kv_quality.py on the trained instrument), a prefix-cache hit giving the tokens of a miss,
chunked prefill and preemption giving those of a roomy pool, the pool's capacity in bytes, what /stats and /metrics
say, and bad values refused with the setting's name.

A quantized engine is compared with itself (hit against miss, pressure against room): its tokens are not
transformers', and greedy equality between two int8 runs needs distributions whose top token is clear of the
second by more than the quantization moves it, which a trained model's are and a random one's are not.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_model import make_engine

from config import EngineSettings
from generate.engine import Engine
from generate.llm import LLM
from generate.sequence import SamplingParams
from model.tokenizer import load_tokenizer

ROOT = Path(__file__).parent.parent
BACKENDS = ["reference", "cpu"]


def prompts() -> list[list[int]]:
    """Python source that shares a prefix (the prefix cache's case), in lengths that cross block edges."""
    encode = load_tokenizer().encode
    head = encode("import os\nimport sys\nfrom pathlib import Path\n\n\n")
    tails = ["def main(", "class Reader:\n    def __init__(self", "def parse(text):\n    ", "if __name__ =="]
    return [head + encode(t) for t in tails] + [encode("for i in range(10):\n")]


def greedy(engine: Engine, counts: list[int]) -> list[list[int]]:
    return engine.generate(prompts(), [SamplingParams(max_tokens=n, temperature=0) for n in counts])


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_int8_cache_meets_its_quality_targets_on_a_trained_model(instrument_checkpoint, tmp_path, backend):
    """The issue's targets for int8: mean KL <= 1e-3, top-1 agreement >= 99 %, perplexity within 0.5 %."""
    out = tmp_path / "quality.json"
    command = [sys.executable, "-m", "benchmarks.kv_quality", "--model", str(instrument_checkpoint)]
    command += ["--modes", "int8-kv", "--backend", backend, "--windows", "6", "--length", "96", "--prefill", "40"]
    subprocess.run(command + ["--json", str(out)], cwd=ROOT, check=True, timeout=300, capture_output=True)
    record = json.loads(out.read_text())
    exact, int8 = record["results"]["exact"], record["results"]["int8-kv"]
    assert exact["mean_kl"] == 0 and exact["top1_agreement"] == 1  # the exact engine against itself
    assert int8["positions"] == 6 * 96
    assert int8["mean_kl"] <= 1e-3 and int8["top1_agreement"] >= 0.99, int8
    assert abs(int8["perplexity_change"]) <= 0.005, int8


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefix_cache_hit_gives_the_tokens_of_a_miss(instrument_checkpoint, backend):
    counts = [12, 9, 16, 5, 10]
    miss = greedy(
        make_engine(instrument_checkpoint, attention=backend, prefix_cache=False, kv_cache_dtype="int8"), counts
    )
    engine = make_engine(instrument_checkpoint, attention=backend, kv_cache_dtype="int8")
    greedy(engine, [1] * len(counts))  # the prompts' blocks into the prefix cache
    assert greedy(engine, counts) == miss
    assert engine.scheduler.prompt_tokens_cached > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_and_preemption_give_the_tokens_of_a_roomy_pool(instrument_checkpoint, backend):
    counts = [30, 22, 40, 12, 26]
    roomy = make_engine(instrument_checkpoint, attention=backend, num_blocks=256, kv_cache_dtype="int8")
    tight = make_engine(
        instrument_checkpoint, attention=backend, num_blocks=24, max_batch_tokens=8, kv_cache_dtype="int8"
    )
    assert greedy(tight, counts) == greedy(roomy, counts)
    assert tight.scheduler.num_preemptions > 0
    tight.blocks.check_integrity([])


def test_the_pool_holds_more_blocks_in_as_many_bytes(tiny_checkpoint):
    """KV_CACHE_GB buys 3.5x float32's blocks with int8 and ~1.9x bfloat16's: a byte a value and a float32 scale
    per head of 64 values (8 bytes per head here, where heads are 32 wide: less, but still well over 3x)."""

    def blocks(dtype: str, cache: str) -> int:
        return LLM(str(tiny_checkpoint), dtype=dtype, kv_cache_gb=0.01, kv_cache_dtype=cache).engine.blocks.num_blocks

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    head_dim = config["n_embd"] // config["n_head"]
    float32, bfloat16, int8 = blocks("float32", "auto"), blocks("bfloat16", "auto"), blocks("float32", "int8")
    assert int8 / float32 == pytest.approx(4 * head_dim / (head_dim + 4), rel=0.01)  # bytes per head's row
    assert int8 / bfloat16 == pytest.approx(2 * head_dim / (head_dim + 4), rel=0.01)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(kv_cache_dtype="int4"), "KV_CACHE_DTYPE must be one of auto, int8, fp8, fp8_e4m3, fp8_e5m2"),
        (dict(kv_cache_dtype="fp8", attention_backend="auto", device="cpu"), "KV_CACHE_DTYPE=fp8 runs on CUDA"),
        (dict(kv_cache_dtype="int8", attention_backend="cpu", dtype="float16"), "ATTENTION_BACKEND=cpu runs on"),
    ],
)
def test_a_bad_value_is_refused_by_name(tiny_checkpoint, settings, message):
    with pytest.raises(ValueError, match=message):
        Engine.from_settings(EngineSettings(model=str(tiny_checkpoint), kv_cache_blocks=16, **settings))


def test_stats_and_metrics_say_the_cache_dtype_and_its_blocks(make_app):
    app, _ = make_app(kv_cache_dtype="int8", kv_cache_blocks=100)
    client = app.test_client()
    answer = client.post("/v1/completions", json={"prompt": "import os", "max_tokens": 3, "temperature": 0})
    assert answer.status_code == 200, answer.get_json()
    stats = client.get("/stats").get_json()
    assert stats["kv_cache_dtype"] == "int8" and stats["kv_blocks_total"] == 100
    text = client.get("/metrics").get_data(as_text=True)
    (info,) = [s for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info" for s in f.samples]
    assert info.value == 1
    assert info.labels["cache_dtype"] == "int8" and info.labels["num_gpu_blocks"] == "100"
    assert info.labels["block_size"] == "16" and info.labels["enable_prefix_caching"] == "True"
