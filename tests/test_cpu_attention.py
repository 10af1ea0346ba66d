"""The C++ paged-attention kernel for CPUs against attention written from scratch, and the engine through it
against transformers; over an int8 cache, against attention over the cache it dequantizes to and over the values it
quantized, and its store against model.attention.quantize."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attention_oracle import LAYOUTS, SHAPES, D, H, dense_attention, random_cache, scheduled
from conftest import random_prompts
from test_model import check_greedy_under_pressure, make_engine

from config import EngineSettings
from generate.llm import LLM, SamplingParams
from generate.model_runner import ModelRunner
from generate.sequence import Sequence
from generate.step_input import build_step_inputs
from model import cpu_attention
from model.attention import LayerKV, dequantize, paged_cache, paged_scales, quantize
from model.gpt2 import GPT, GPTConfig

if not cpu_attention.available():
    pytest.skip(f"the kernel does not build here: {cpu_attention.build_problem()}", allow_module_level=True)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(params=[32, sys.maxsize], ids=["long-runs-fused", "kernel-only"])
def long_run(request, monkeypatch) -> int:
    """Both ways a step's rows can be parted, on any CPU (cpu_attention.long_run_for picks one per machine): long
    runs of a prompt to torch's fused attention from 32 rows, or every row to the kernel."""
    monkeypatch.setattr(cpu_attention, "LONG_RUN", request.param)
    return request.param


def test_long_runs_go_to_the_kernel_where_its_vector_form_is_the_faster():
    assert cpu_attention.long_run_for({"avx512f", "avx512_bf16", "avx2"}) == sys.maxsize  # Zen 4
    assert cpu_attention.long_run_for({"avx2", "fma"}) == 32  # Zen 3: the kernel's scalar form
    assert cpu_attention.long_run_for({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}) == 32  # Sapphire Rapids


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_equals_dense_attention(shapes, dtype, block_size, layout, long_run):
    seqs = scheduled(block_size, num_blocks=600, shapes=SHAPES[shapes], seed=len(shapes))
    gen = torch.Generator().manual_seed(0)
    caches = [random_cache(layout, 600, block_size, gen).to(dtype) for _ in range(2)]
    rows = sum(s.num_scheduled_tokens for s in seqs)
    q = torch.randn((rows, 3 * H * D), generator=gen).to(dtype)[:, : H * D].view(rows, H, D)  # strided, as the model's
    expected = dense_attention(q, *caches, seqs, block_size)
    got = cpu_attention.CpuAttention(build_step_inputs(seqs, block_size, CPU).paged).attend(q, LayerKV(*caches))
    torch.testing.assert_close(got.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("budget", [24, 96])  # 96: prompts of 43 and 63 tokens go whole (long runs)
def test_greedy_output_through_the_kernel_equals_transformers(
    tiny_checkpoint, hf_greedy, prefix_cache, budget, long_run
):
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
    assert runner(32, kv_cache_dtype="int8").attention == "cpu"
    assert runner(32, torch.bfloat16, kv_cache_dtype="int8").attention == "cpu"
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
    held = held_slots(seqs, 600, block_size)
    for cache in caches:
        cache[~held] = float("nan")
    rows = sum(s.num_scheduled_tokens for s in seqs)
    q = torch.randn((rows, H, D), generator=gen).to(dtype)
    expected = dense_attention(q, *caches, seqs, block_size)
    got = cpu_attention.CpuAttention(build_step_inputs(seqs, block_size, CPU).paged).attend(q, LayerKV(*caches))
    torch.testing.assert_close(got.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def held_slots(seqs: list[Sequence], num_blocks: int, block_size: int) -> torch.Tensor:
    """[NB, bs] True at each slot of a sequence's context: the slots the kernel may read."""
    held = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for seq in seqs:
        held.view(-1)[torch.tensor(seq.block_table)[:, None] * block_size + torch.arange(block_size)] = True
        last, used = seq.block_table[-1], (seq.num_computed_tokens + seq.num_scheduled_tokens - 1) % block_size + 1
        held[last, used:] = False
    return held


def int8_cache(held: torch.Tensor, heads: int, head_dim: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random keys or values [NB, bs, H, D] (rows of many magnitudes, so of many scales), and the same as the engine
    stores them: (values float32, int8 [NB, bs, H, D] head by head, scales [NB, bs, H]). Every slot outside `held` is
    NaN in the values and the scales, and -128 (which quantize never writes) in the int8 data."""
    num_blocks, block_size = held.shape
    x = torch.randn((num_blocks, block_size, heads, head_dim), generator=gen)
    x *= 0.1 + 4 * torch.rand((num_blocks, block_size, heads, 1), generator=gen)
    stored, scale = quantize(x.view(-1, heads, head_dim), torch.int8)  # [NB*bs, H, D], [NB*bs, H]
    data = paged_cache(blocks=num_blocks, block_size=block_size, heads=heads, head_dim=head_dim, dtype=torch.int8)
    scales = paged_scales(blocks=num_blocks, block_size=block_size, heads=heads, device=CPU)
    data.view(-1, heads, head_dim).copy_(stored)
    scales.view(-1, heads).copy_(scale)
    x[~held], data[~held], scales[~held] = float("nan"), -128, float("nan")
    return x, data, scales


@pytest.mark.parametrize("shapes", SHAPES)  # decodes, chunks (one of them a long run), a 1024-token prompt
@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("head_dim", [64, 16])  # decode rows: 64 on AVX-512 the vector path, 16 the scalar one
def test_kernel_over_an_int8_cache(shapes, dtype, block_size, head_dim, long_run):
    """(a) Against attention over the cache dequantized, to the kernel's float tolerance: exactly (in float64) for the
    kernel's rows, which scale the int8 values in float32, and in the queries' dtype for a long run's, which torch's
    fused attention reads as the reference backend does (model.attention.dequantize); the same numbers summed in
    another order. (b) Against attention over the values before quantization, within the bound dense_attention derives
    from the quantization error: a stored value reads back within s / 2 of x (s its row's max|x| / 127), and a
    reader that dequantizes into a dtype of unit roundoff u rounds it once more, by at most 127 s u: within
    (1/2 + 127 u) s. Every slot outside the contexts poisoned (NaN, -128)."""
    seqs = scheduled(block_size, num_blocks=600, shapes=SHAPES[shapes], seed=len(shapes) + head_dim)
    gen = torch.Generator().manual_seed(head_dim)
    held = held_slots(seqs, 600, block_size)
    (k, k_data, k_scale), (v, v_data, v_scale) = (int8_cache(held, H, head_dim, gen) for _ in range(2))
    rows = sum(s.num_scheduled_tokens for s in seqs)
    q = torch.randn((rows, 3 * H * head_dim), generator=gen).to(dtype)[:, : H * head_dim].view(rows, H, head_dim)
    cache = LayerKV(k_data, v_data, k_scale, v_scale)
    got = cpu_attention.CpuAttention(build_step_inputs(seqs, block_size, CPU).paged).attend(q, cache).double()
    assert got.isfinite().all()

    quantized = ((k_data, k_scale), (v_data, v_scale))
    exact = dense_attention(
        q, *(data.double() * scale.double()[..., None] for data, scale in quantized), seqs, block_size
    )
    as_read = dense_attention(q, *(dequantize(data, scale, dtype) for data, scale in quantized), seqs, block_size)
    long = torch.cat([torch.full((s.num_scheduled_tokens, 1), s.num_scheduled_tokens >= long_run) for s in seqs])
    torch.testing.assert_close(got, torch.where(long, as_read, exact), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])

    rounding = torch.finfo(dtype).eps / 2  # a long run's copy in the queries' dtype
    errors = [(0.5 + 127 * rounding) * scale.double()[..., None].expand(k.shape) for scale in (k_scale, v_scale)]
    unquantized, bound = dense_attention(q, k, v, seqs, block_size, errors)
    allowed = bound + TOLERANCE[dtype] * (1 + unquantized.abs())  # and the kernel's own rounding, as in (a)
    assert ((got - unquantized).abs() <= allowed).all(), ((got - unquantized).abs() - allowed).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 50])  # 5 on the calling thread, 50 shared between torch's threads
def test_store_copies_each_row_into_its_slot_and_nothing_else(dtype, rows):
    """Keys and values from the model's strided [T, H, D] rows, each (row, head) in its slot of the head-major
    cache exactly (a copy), with 2 threads where this machine has them; every other slot keeps its poison."""
    num_blocks, block_size, heads, head_dim = 40, 4, 3, 16
    gen = torch.Generator().manual_seed(rows)
    caches = [paged_cache(blocks=num_blocks, block_size=block_size, heads=heads, head_dim=head_dim, dtype=dtype)
              for _ in range(2)]  # fmt: skip
    for cache in caches:
        cache.fill_(float("nan"))
    k, v = (torch.randn((rows, 3 * heads * head_dim), generator=gen).to(dtype) for _ in range(2))
    k, v = (x[:, : heads * head_dim].view(rows, heads, head_dim) for x in (k, v))  # strided, as the model's
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    try:
        cpu_attention.CpuAttention.store(LayerKV(*caches), k, v, slots)
    finally:
        torch.set_num_threads(threads)

    for x, stored in ((k, caches[0]), (v, caches[1])):
        assert torch.equal(stored.view(-1, heads, head_dim)[slots], x)
        others = torch.ones(num_blocks * block_size, dtype=torch.bool)
        others[slots] = False
        assert stored.view(-1, heads, head_dim)[others].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 16, 8])  # 8: no whole vector of 16, the scalar quantization
def test_store_quantizes_each_row_into_its_slot_and_nothing_else(dtype, head_dim):
    """Each (row, head) as model.attention.quantize writes it, in its slot: the scale to the bit (the same float32
    operations), the values within one (the kernel multiplies by the scale's reciprocal, quantize divides by it:
    x / scale within a rounding error of a half can round either way). Every other slot keeps its poison."""
    num_blocks, block_size, heads, rows = 40, 4, 3, 50
    gen = torch.Generator().manual_seed(head_dim)
    data = [paged_cache(blocks=40, block_size=4, heads=heads, head_dim=head_dim, dtype=torch.int8) for _ in range(2)]
    scales = [paged_scales(blocks=40, block_size=4, heads=heads, device=CPU) for _ in range(2)]
    for tensor, poison in ((data[0], -128), (data[1], -128), (scales[0], float("nan")), (scales[1], float("nan"))):
        tensor.fill_(poison)
    k, v = (torch.randn((rows, 3 * heads * head_dim), generator=gen) for _ in range(2))  # strided, as the model's
    k, v = (x[:, : heads * head_dim].view(rows, heads, head_dim) for x in (k, v))
    k[:, 0] *= torch.logspace(-3, 4, rows)[:, None]  # head 0's rows from a thousandth to ten thousand
    k[0], v[1] = 0, 0  # a row of zeros: scale 1
    ties = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 0.5, 126.5, -126.5])  # scale 1: halves, to even
    k[2, 1] = ties.repeat(head_dim // 8)
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    cpu_attention.CpuAttention.store(LayerKV(*data, *scales), k, v, slots)

    for x, stored, scale in ((k, data[0], scales[0]), (v, data[1], scales[1])):
        expected, expected_scale = quantize(x, torch.int8)  # [T, H, D], [T, H]
        got = stored.view(-1, heads, head_dim)[slots]
        assert (got.int() - expected.int()).abs().max() <= 1
        assert torch.equal(scale.view(-1, heads)[slots], expected_scale)
        others = torch.ones(num_blocks * block_size, dtype=torch.bool)
        others[slots] = False
        assert (stored.view(-1, heads, head_dim)[others] == -128).all()
        assert scale.view(-1, heads)[others].isnan().all()
    assert data[0].view(-1, heads, head_dim)[slots[2], 1].tolist() == [127, 2, 4, 0, -2, 0, 126, -126] * (head_dim // 8)
    assert data[0].view(-1, heads, head_dim)[slots[0]].eq(0).all() and scales[0].view(-1, heads)[slots[0]].eq(1).all()


def test_auto_takes_the_kernel_over_an_int8_cache_and_decodes_as_the_reference(tiny_checkpoint):
    """The engine with KV_CACHE_DTYPE=int8: auto picks the kernel on a CPU, and its greedy tokens equal the reference
    backend's over the same int8 cache (float32: the two differ in summation order alone). Prompts sharing a
    prefix, chunked (some chunks long runs, to torch's fused attention) and decoding beside each other."""
    (prefix,) = random_prompts([13], seed=41)
    prompts = random_prompts([1, 30, 7, 50, 4, 70], seed=42, prefix=prefix)
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (20, 9, 30, 12, 25, 16)]
    tokens = {}
    for backend in ("auto", "reference"):
        settings = dict(dtype="float32", kv_cache_dtype="int8", kv_cache_blocks=96, block_size=4, max_batch_tokens=48)
        llm = LLM(str(tiny_checkpoint), attention_backend=backend, **settings)
        assert llm.engine.runner.attention == ("cpu" if backend == "auto" else "reference")
        tokens[backend] = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    assert tokens["auto"] == tokens["reference"]
