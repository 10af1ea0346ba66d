"""The C++ paged-attention kernel for CPUs against attention written from scratch, and the engine through it
against transformers."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attention_oracle import LAYOUTS, SHAPES, D, H, dense_attention, random_cache, scheduled
from test_model import check_greedy_under_pressure, make_engine

from config import EngineSettings
from generate.model_runner import ModelRunner
from generate.step_input import build_step_inputs
from model import cpu_attention
from model.attention import LayerKV
from model.gpt2 import GPT, GPTConfig

if not cpu_attention.available():
    pytest.skip(f"the kernel does not build here: {cpu_attention.build_problem()}", allow_module_level=True)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_equals_dense_attention(shapes, dtype, block_size, layout):
    seqs = scheduled(block_size, num_blocks=600, shapes=SHAPES[shapes], seed=len(shapes))
    gen = torch.Generator().manual_seed(0)
    caches = [random_cache(layout, 600, block_size, gen).to(dtype) for _ in range(2)]
    rows = sum(s.num_scheduled_tokens for s in seqs)
    q = torch.randn((rows, 3 * H * D), generator=gen).to(dtype)[:, : H * D].view(rows, H, D)  # strided, as the model's
    expected = dense_attention(q, *caches, seqs, block_size)
    got = cpu_attention.CpuAttention(build_step_inputs(seqs, block_size, CPU).paged).attend(q, LayerKV(*caches))
    torch.testing.assert_close(got.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("budget", [24, 96])  # 96: prompts of 43 and 63 tokens go whole, to torch's fused attention
def test_greedy_output_through_the_kernel_equals_transformers(tiny_checkpoint, hf_greedy, prefix_cache, budget):
    engine = make_engine(
        tiny_checkpoint,
        num_blocks=40,  # tight: sequences are preempted and recomputed
        block_size=4,
        attention="cpu",
        max_batch_tokens=budget,  # prompts are chunked, and chunks share steps with decodes
        prefix_cache=prefix_cache,
    )
    check_greedy_under_pressure(engine, hf_greedy)


def runner(n_embd: int, dtype: torch.dtype = torch.float32, **settings) -> ModelRunner:
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=n_embd, n_positions=64, vocab_size=100)).to(dtype)
    return ModelRunner.from_settings(model, 8, EngineSettings(block_size=4, **settings))


def test_auto_takes_the_kernel_on_a_cpu_where_it_fits():
    assert runner(32).attention == "cpu"  # head dimension 16
    assert runner(32, torch.bfloat16).attention == "cpu"
    assert runner(96).attention == "reference"  # 48 is not compiled in
    assert runner(32, attention_backend="reference").attention == "reference"
    with pytest.raises(ValueError, match="head dimension of 8, 16, 32, 64, 128: not cpu, torch.float32, 48"):
        runner(96, attention_backend="cpu")
    with pytest.raises(ValueError, match="not cpu, torch.float16, 16"):
        runner(32, torch.float16, attention_backend="cpu")


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path):
    """torch's build lock is a plain file: a process killed mid-build leaves it, and torch alone then waits on it
    forever. A fresh process, over a copy of the built kernel with such a lock in it, must load it all the same."""
    name = cpu_attention.extension_name()
    locks = shutil.ignore_patterns("lock", "flock")
    shutil.copytree(cpu_attention.build_directory(), tmp_path / name, ignore=locks)  # keeps mtimes: no rebuild
    (tmp_path / name / "lock").touch()
    load = "from model import cpu_attention; print(cpu_attention.build_problem())"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", load], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None", done.stderr
    assert not (tmp_path / name / "lock").exists()


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("block_size", [16, 4])
def test_kernel_reads_no_slot_past_a_sequence_context(dtype, block_size):
    """Every slot no sequence holds, and every slot past a context in its last block, is NaN: one read of them
    would poison the row (the kernel reads keys 16 at a time, and a block's last group is partial)."""
    shapes = SHAPES["decodes"] + SHAPES["chunks"]
    seqs = scheduled(block_size, num_blocks=600, shapes=shapes, seed=3)
    gen = torch.Generator().manual_seed(1)
    caches = [random_cache("head-major", 600, block_size, gen).to(dtype) for _ in range(2)]
    held = torch.zeros(600, block_size, dtype=torch.bool)  # [NB, bs]
    for seq in seqs:
        held.view(-1)[torch.tensor(seq.block_table)[:, None] * block_size + torch.arange(block_size)] = True
        last, used = seq.block_table[-1], (seq.num_computed_tokens + seq.num_scheduled_tokens - 1) % block_size + 1
        held[last, used:] = False
    for cache in caches:
        cache[~held] = float("nan")
    rows = sum(s.num_scheduled_tokens for s in seqs)
    q = torch.randn((rows, H, D), generator=gen).to(dtype)
    expected = dense_attention(q, *caches, seqs, block_size)
    got = cpu_attention.CpuAttention(build_step_inputs(seqs, block_size, CPU).paged).attend(q, LayerKV(*caches))
    torch.testing.assert_close(got.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
