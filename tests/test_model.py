"""The model against transformers: same logits, and greedy output equal through the paged cache."""

import json
import shutil

import pytest
import torch
from conftest import random_prompts

from config import EngineSettings
from generate.engine import Engine
from generate.model_runner import ModelRunner
from generate.sequence import SamplingParams, Sequence
from generate.step_input import build_step_inputs, reference_groups
from model.attention import CACHE_DTYPES, ReferenceAttention
from model.gpt2 import StepBatch, gelu_new
from model.loader import ModelLoadError, load_model, resolve_model

CPU = torch.device("cpu")


def make_engine(checkpoint, num_blocks=256, block_size=4, attention="reference", graphs="off", **settings) -> Engine:
    """A float32 engine on CPU, but for the Triton kernel on a machine with a GPU. Without one the kernel
    runs under Triton's interpreter, and graphs="eager" runs the CUDA-graph runner's static buffers without
    capture."""
    device = torch.device("cuda") if attention == "triton" and torch.cuda.is_available() else CPU
    loaded = load_model(str(checkpoint), device, torch.float32)
    settings = EngineSettings(block_size=block_size, **settings)
    max_batch = settings.max_running(device.type == "cuda", loaded.model.config.n_positions)
    cache = CACHE_DTYPES[settings.kv_cache_dtype]
    runner = ModelRunner(loaded.model, num_blocks, block_size, attention, graphs, max_batch, cache_dtype=cache)
    return Engine(runner, num_blocks, settings, loaded.name)


def check_greedy_under_pressure(engine: Engine, hf_greedy) -> None:
    """Prompts sharing a prefix, chunked and preempted in a tight pool: every greedy output equals transformers'."""
    (prefix,) = random_prompts([13], seed=31)
    prompts = random_prompts([1, 30, 7, 50, 4, 18, 2], seed=32, prefix=prefix)
    counts = [20, 9, 30, 12, 25, 16, 22]
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in counts])
    assert outputs == [hf_greedy(p, n) for p, n in zip(prompts, counts)]
    assert engine.scheduler.num_preemptions > 0
    engine.blocks.check_integrity([])


def run_checked(engine: Engine, seqs: list[Sequence]) -> None:
    """Add the sequences and run the engine dry, checking every block's owners after every step."""
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step()
        engine.blocks.check_integrity(list(engine.scheduler.running) + list(engine.scheduler.waiting))
    engine.blocks.check_integrity([])
    assert engine.blocks.num_used_blocks == 0


def logits_of(engine: Engine, seq: Sequence, start: int, end: int) -> torch.Tensor:
    """Logits at positions start..end-1, computing them over the cached positions before."""
    seq.num_computed_tokens = start
    view = _upto(seq, end)
    inputs = build_step_inputs([view], engine.blocks.block_size, CPU)
    attention = ReferenceAttention(reference_groups([view], engine.blocks.block_size, CPU), engine.runner.space)
    batch = StepBatch(inputs.input_ids, inputs.positions, inputs.slot_mapping, attention, logits_rows=None)
    return engine.runner.model(batch)


def _upto(seq: Sequence, end: int) -> Sequence:
    view = Sequence(seq.token_ids[:end])
    view.block_table, view.num_computed_tokens = seq.block_table, seq.num_computed_tokens
    view.num_scheduled_tokens = end - seq.num_computed_tokens
    return view


def test_logits_match_transformers(tiny_checkpoint, hf_model):
    engine = make_engine(tiny_checkpoint)
    (prompt,) = random_prompts([45])
    seq = Sequence(list(prompt))
    engine.blocks.allocate(seq)
    expected = hf_model(torch.tensor([prompt])).logits[0]  # [45, V]
    torch.testing.assert_close(logits_of(engine, seq, 0, 45), expected, atol=1e-4, rtol=1e-4)
    # The same logits when the first 30 positions come from the cache written above.
    torch.testing.assert_close(logits_of(engine, seq, 30, 45), expected[30:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_is_gpt2s_tanh_form_in_any_range(dtype):
    x = torch.linspace(-30, 30, 20001, dtype=torch.float64)  # saturated tails, and around 0
    u = (2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)
    expected = 0.5 * x * (1 + torch.tanh(u))  # transformers' NewGELUActivation, in float64
    got = gelu_new(x.to(dtype)).double()  # on a CPU in float32: x sigmoid(2u); in bfloat16: torch's own
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got, expected, rtol=8 * eps, atol=8 * eps)


def test_padded_vocabulary_keeps_the_logits_and_the_tied_head(tiny_checkpoint, hf_model):
    """On CUDA the runner pads the embedding to 64-row multiples (cuBLAS's fast kernels); logits stay [N, V]."""
    engine = make_engine(tiny_checkpoint)
    model = engine.runner.model
    model.pad_vocab(64)
    assert model.wte.weight.shape[0] % 64 == 0 and model.lm_head.weight is model.wte.weight
    assert not model.wte.weight[model.config.vocab_size :].any()  # the new rows are zeros
    (prompt,) = random_prompts([21], seed=5)
    seq = Sequence(list(prompt))
    engine.blocks.allocate(seq)
    expected = hf_model(torch.tensor([prompt])).logits[0]  # [21, V]
    torch.testing.assert_close(logits_of(engine, seq, 0, 21), expected, atol=1e-4, rtol=1e-4)


def test_greedy_batch_with_mixed_steps_matches_transformers_alone(tiny_checkpoint, hf_greedy):
    engine = make_engine(tiny_checkpoint)
    prompts = random_prompts([1, 7, 16, 33, 50, 3], seed=1)
    lengths = [40, 32, 47, 35, 33, 60]
    seqs = [Sequence(list(p), SamplingParams(max_tokens=n, temperature=0)) for p, n in zip(prompts, lengths)]
    # Admit in waves, so new prompts' prefills share steps with running sequences' decodes.
    mixed_steps = 0
    for wave in (seqs[:2], seqs[2:4], seqs[4:]):
        for seq in wave:
            engine.add(seq)
        for _ in range(3):
            mixed_steps += bool(engine.scheduler.running and engine.scheduler.waiting)
            engine.step()
    assert mixed_steps == 2  # the second and third waves joined running sequences
    while engine.has_work():
        engine.step()
    for seq, prompt, n in zip(seqs, prompts, lengths):
        assert seq.completion_ids == hf_greedy(prompt, n)
    engine.blocks.check_integrity([])
    assert engine.blocks.num_used_blocks == 0


def test_before_forward_is_called_in_each_step_once_its_inputs_are_built(tiny_checkpoint, hf_greedy):
    """Engine.before_forward (where the engine's process sends the step before's outputs): once in every step,
    prefill or decode, after the step's inputs are built and before the model runs."""
    engine = make_engine(tiny_checkpoint)
    events: list[str] = []
    forward = engine.runner.model.forward
    engine.runner.model.forward = lambda *args: events.append("forward") or forward(*args)
    engine.before_forward = lambda: events.append("inputs built")
    prompts = random_prompts([5, 9], seed=3)
    assert engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in (4, 6)]) == [
        hf_greedy(prompts[0], 4),
        hf_greedy(prompts[1], 6),
    ]
    assert engine.num_steps >= 6 and events == ["inputs built", "forward"] * engine.num_steps


def test_loads_pytorch_bin_checkpoints(tiny_checkpoint, hf_model, tmp_path):
    shutil.copy(tiny_checkpoint / "config.json", tmp_path)
    torch.save(hf_model.state_dict(), tmp_path / "pytorch_model.bin")
    a = load_model(str(tiny_checkpoint), CPU, torch.float32).model.state_dict()
    b = load_model(str(tmp_path), CPU, torch.float32).model.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_random_weights_are_seeded():
    a = load_model("random:gpt2", CPU, torch.float32, seed=3).model
    b = load_model("random:gpt2", CPU, torch.float32, seed=3).model
    c = load_model("random:gpt2", CPU, torch.float32, seed=4).model
    assert torch.equal(a.h[5].mlp.c_fc.weight, b.h[5].mlp.c_fc.weight)
    assert not torch.equal(a.h[5].mlp.c_fc.weight, c.h[5].mlp.c_fc.weight)
    assert a.config.n_layer == 12 and a.config.n_embd == 768


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gpt5-ultra", "unknown model 'gpt5-ultra'"),
        ("random:gpt3", "unknown model 'random:gpt3'"),
    ],
)
def test_unknown_models_are_refused(spec, message):
    with pytest.raises(ModelLoadError, match=message):
        resolve_model(spec)


def test_directory_without_weights(tiny_checkpoint, tmp_path):
    shutil.copy(tiny_checkpoint / "config.json", tmp_path)
    with pytest.raises(ModelLoadError, match="no model.safetensors or pytorch_model.bin"):
        load_model(str(tmp_path), CPU, torch.float32)


def test_config_that_is_not_gpt2(tiny_checkpoint, tmp_path):
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="not a GPT-2 config"):
        resolve_model(str(tmp_path))


def test_prompt_longer_than_context_is_refused_before_work(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    with pytest.raises(ValueError, match=r"prompt \(1020 tokens\) \+ max tokens \(10\) = 1030 exceeds the 1024"):
        engine.add(Sequence([1] * 1020, SamplingParams(max_tokens=10)))
    assert not engine.has_work() and engine.num_steps == 0
