"""LoRA adapters in the engine: several adapters and the base in one batch give each peft's merged model's
greedy tokens, under chunked prefill, preemption and the prefix cache; bad adapters are refused by name."""

import pytest
import torch
from conftest import random_prompts, save_lora

from config import EngineSettings
from generate.engine import Engine
from generate.lora_registry import LoraInUse, LoraNotFound
from generate.model_runner import ModelRunner
from generate.sequence import SamplingParams, Sequence
from model.loader import load_model
from model.lora import LoraError

NEW_TOKENS = 12
ADAPTERS = [None, "alpha", "beta", "gamma"]  # None: the base model


def lora_engine(checkpoint, adapters: dict, num_blocks: int = 256, block_size: int = 4, **settings) -> Engine:
    """A float32 CPU engine with `adapters` (name -> directory) loaded as LORA_MODULES would."""
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    settings = EngineSettings(block_size=block_size, lora_modules=modules, **settings)
    loaded = load_model(str(checkpoint), torch.device("cpu"), torch.float32)
    max_batch = settings.max_running(False, loaded.model.config.n_positions)
    runner = ModelRunner(loaded.model, num_blocks, block_size, max_batch_size=max_batch, max_loras=settings.max_loras)
    engine = Engine(runner, num_blocks, settings, loaded.name)
    engine.loras.load_modules(settings.lora_modules)
    return engine


def run(engine: Engine, jobs: list[tuple[str | None, list[int]]]) -> tuple[list[Sequence], list[set[int]]]:
    """Run every (adapter, prompt) to the end, all added at once; the sequences, and each step's adapter ids."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    seqs = [Sequence(list(p), params, lora=engine.loras.get(a) if a else None) for a, p in jobs]
    for seq in seqs:
        engine.add(seq)
    steps = []
    while engine.has_work():
        steps.append({seq.lora_id for seq, _ in engine.step()})
        engine.blocks.check_integrity(list(engine.scheduler.running) + list(engine.scheduler.waiting))
    return seqs, steps


def mixed_jobs() -> list[tuple[str | None, list[int]]]:
    """Two prompts of a shared prefix for each adapter and the base, and one same prompt for all four."""
    (prefix,) = random_prompts([13], seed=40)
    prompts = random_prompts([3, 9, 1, 17, 6, 11, 4, 2], seed=41, prefix=prefix)
    (same,) = random_prompts([10], seed=42)
    return [(ADAPTERS[i % 4], p) for i, p in enumerate(prompts)] + [(a, same) for a in ADAPTERS]


@pytest.mark.parametrize("budget", [16, 256])
def test_adapters_and_base_in_one_batch_equal_peft_merged(tiny_checkpoint, lora_adapters, peft_greedy, budget):
    engine = lora_engine(tiny_checkpoint, lora_adapters, max_batch_tokens=budget)
    jobs = mixed_jobs()
    for _ in range(2):  # the second round reads the first's blocks from the prefix cache
        seqs, steps = run(engine, jobs)
        assert [s.completion_ids for s in seqs] == [peft_greedy(a, p, NEW_TOKENS) for a, p in jobs]
    assert max(len(ids) for ids in steps) == 4  # three adapters and the base shared steps
    assert engine.scheduler.prompt_tokens_cached > 0
    same = [s.completion_ids for s in seqs[-4:]]  # one prompt through each: four different answers
    assert len({tuple(c) for c in same}) == 4
    assert engine.blocks.num_used_blocks == 0


def test_preemption_and_max_loras(tiny_checkpoint, lora_adapters, peft_greedy):
    # 20 blocks of 4 tokens for 12 sequences of up to 42 tokens: preemption; 2 slots for 3 adapters.
    engine = lora_engine(tiny_checkpoint, lora_adapters, num_blocks=20, max_batch_tokens=32, max_loras=2)
    jobs = mixed_jobs()
    seqs, steps = run(engine, jobs)
    assert [s.completion_ids for s in seqs] == [peft_greedy(a, p, NEW_TOKENS) for a, p in jobs]
    assert engine.scheduler.num_preemptions > 0
    assert max(len(ids - {0}) for ids in steps) == 2  # never more adapters in a step than MAX_LORAS
    assert engine.runner.lora_slots.num_loads > 3  # slots were refilled as adapters came and went


def test_prefix_cache_blocks_are_kept_apart_by_adapter(tiny_checkpoint, lora_adapters):
    engine = lora_engine(tiny_checkpoint, lora_adapters)
    (prompt,) = random_prompts([21], seed=43)  # five full blocks to share
    cached = {}
    for adapter in ["alpha", "beta", "alpha", None, "beta"]:
        (seq,), _ = run(engine, [(adapter, prompt)])
        cached.setdefault(adapter, []).append(seq.num_cached_prompt_tokens)
    assert cached == {"alpha": [0, 20], "beta": [0, 20], None: [0]}


def test_unload_refused_while_in_flight_and_names_checked(tiny_checkpoint, lora_adapters):
    engine = lora_engine(tiny_checkpoint, {"alpha": lora_adapters["alpha"]})
    registry = engine.loras
    with pytest.raises(ValueError, match="'alpha' has already been loaded"):
        registry.load("alpha", str(lora_adapters["beta"]))
    adapter = registry.get("alpha")
    registry.hold(adapter)
    with pytest.raises(LoraInUse, match="in use by 1"):
        registry.unload("alpha")
    registry.release(adapter)
    registry.unload("alpha")
    assert registry.get("alpha") is None
    with pytest.raises(LoraNotFound, match="'alpha' cannot be found"):
        registry.unload("alpha")
    again = registry.load("alpha", str(lora_adapters["alpha"]))
    assert again.id != adapter.id  # a new load keys new cache blocks


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(r=4, target_modules=["lm_head"]), "'lm_head' is not supported"),
        (dict(r=4, target_modules=["wte"]), "'transformer.wte' is not supported"),
        (dict(r=32, target_modules=["c_attn"]), "rank 32 exceeds MAX_LORA_RANK \\(16\\)"),
        (dict(r=4, target_modules=["c_attn"], use_dora=True), "DoRA"),
    ],
)
def test_unservable_adapters_are_refused_by_name(tiny_checkpoint, tmp_path, config, match):
    engine = lora_engine(tiny_checkpoint, {})
    path = save_lora(tiny_checkpoint, tmp_path / "a", 0, **config)
    with pytest.raises(LoraError, match=match):
        engine.loras.load("a", str(path))
    assert engine.loras.adapters() == []


def test_missing_foreign_and_other_dimension_adapters_are_refused(tiny_checkpoint, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    engine = lora_engine(tiny_checkpoint, {})
    for missing in (tmp_path / "nowhere", tiny_checkpoint):  # no directory; a directory without the files
        with pytest.raises(LoraError, match="cannot load adapter .*: it must be a directory holding adapter_config"):
            engine.loras.load("a", str(missing))
    wider = tmp_path / "wider"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=32)).save_pretrained(wider)
    path = save_lora(wider, tmp_path / "b", 0, r=4, target_modules=["c_attn"])
    with pytest.raises(LoraError, match="an adapter for other dimensions"):
        engine.loras.load("b", str(path))
