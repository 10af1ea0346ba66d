"""The Triton paged-attention kernel against dense attention, and the CUDA-graph runner's static buffers; over
quantized caches (KV_CACHE_DTYPE int8, fp8_e4m3, fp8_e5m2) too, and the store kernel quantizing as it writes.

Without a GPU both run on CPU: the kernel under Triton's interpreter (conftest sets
TRITON_INTERPRET=1), the graph runner with capture off. A GPU run covers the compiled kernel
and graph capture and replay.
"""

import pytest
import torch
from attention_oracle import LAYOUTS, SHAPES, D, H, dense_attention, random_cache, scheduled
from conftest import random_prompts
from test_model import check_greedy_under_pressure, make_engine

pytest.importorskip("triton", reason="the Triton kernel needs the triton package")

from config import EngineSettings  # noqa: E402
from generate.cuda_graphs import batch_ladder  # noqa: E402
from generate.engine import Engine  # noqa: E402
from generate.model_runner import ModelRunner  # noqa: E402
from generate.sequence import SamplingParams, Sequence  # noqa: E402
from generate.step_input import build_step_inputs  # noqa: E402
from model.attention import (  # noqa: E402
    CACHE_DTYPES,
    QMAX,
    LayerKV,
    as_bytes,
    dequantize,
    paged_cache,
    paged_scales,
    quantize,
    store,
)
from model.loader import load_model  # noqa: E402
from model.triton_attention import KernelConfig, TritonAttention, partitions  # noqa: E402
from model.triton_store import store_kv  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# KV_CACHE_DTYPE's quantized caches: 8 bits a value and a float32 scale per token and head (model/attention.py)
QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2"]
POISON = 0x7F  # the byte a slot the kernels must not read holds: NaN in both float8s, 127 in int8 (its scale NaN)


CASES = [
    (shapes, dtype, block_size)
    for shapes in SHAPES
    for dtype in TOLERANCE
    for block_size in (16, 4)
    if shapes != "whole prompt" or (block_size == 16 and dtype != torch.bfloat16)  # slow under the interpreter
]


# Under the interpreter a 1024-token prompt takes half a minute a case. 300 rows take the same paths: 19 tiles of
# 16 query rows (the last one partial), keys over many 32-key iterations (the last one partial), the causal edge
# in every tile. A GPU run takes the 1024.
INTERPRETED_WHOLE_PROMPT = [(300, 300)]


def shapes_of(name: str) -> list[tuple[int, int]]:
    return INTERPRETED_WHOLE_PROMPT if name == "whole prompt" and DEVICE.type == "cpu" else SHAPES[name]


UNSPLIT = KernelConfig(split_target_programs=0)  # decodes through the tiled kernel, as large batches on any device


@pytest.mark.parametrize(("shapes", "dtype", "block_size"), CASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_equals_dense_attention(shapes, dtype, block_size, layout):
    skip_interpreted_bfloat16(dtype)  # decodes take tl.dot too (16-row tiles)
    seqs = scheduled(block_size, num_blocks=600, shapes=shapes_of(shapes), seed=len(shapes))
    gen = torch.Generator().manual_seed(0)
    caches = [random_cache(layout, 600, block_size, gen).to(DEVICE, dtype) for _ in range(2)]
    rows = sum(s.num_scheduled_tokens for s in seqs)
    q = torch.randn((rows, 3 * H * D), generator=gen).to(DEVICE, dtype)[:, : H * D].view(rows, H, D)  # strided
    expected = dense_attention(q.cpu(), *(c.cpu() for c in caches), seqs, block_size)
    paged = build_step_inputs(seqs, block_size, DEVICE).paged
    got = TritonAttention(paged, UNSPLIT).attend(q, LayerKV(*caches)).double().cpu()
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def skip_interpreted_bfloat16(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("Triton's interpreter gets tl.dot of bfloat16 wrong (numpy has no bfloat16): a GPU run checks it")


# Decode steps whose contexts leave partitions empty (1 key, 7, 33: fewer than P * BLOCK_N), fill them unevenly
# (250) or take several loop iterations in each (600), alone and together
SPLIT_SHAPES = {
    "one long": [(1, 600)],
    "short and long": [(1, 1), (1, 7), (1, 250), (1, 33)],
    "three": [(1, 64), (1, 2), (1, 129)],
}
SPLIT = KernelConfig(split_target_programs=64, split_max_partitions=8)  # a few partitions, as on a GPU at batch 1


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("shapes", SPLIT_SHAPES)
def test_split_decode_equals_dense_attention(shapes, block_size, dtype):
    skip_interpreted_bfloat16(dtype)
    seqs = scheduled(block_size, num_blocks=200, shapes=SPLIT_SHAPES[shapes], seed=len(shapes) + block_size)
    gen = torch.Generator().manual_seed(block_size)
    caches = [random_cache("head-major", 200, block_size, gen).to(DEVICE, dtype) for _ in range(2)]
    q = torch.randn((len(seqs), 3 * H * D), generator=gen).to(DEVICE, dtype)[:, : H * D].view(-1, H, D)  # strided
    paged = build_step_inputs(seqs, block_size, DEVICE).paged
    max_keys = paged.block_tables.shape[1] * block_size
    assert partitions(len(seqs), H, max_keys, DEVICE, SPLIT) > 1  # the split kernel, not the tiled one
    got = TritonAttention(paged, SPLIT).attend(q, LayerKV(*caches)).double().cpu()
    expected = dense_attention(q.cpu(), *(c.cpu() for c in caches), seqs, block_size)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_partitions_reach_the_target_within_their_caps():
    config = KernelConfig(split_target_programs=264, split_max_partitions=16, block_n=32)
    for num_seqs, heads, max_keys in [(1, 16, 1024), (2, 16, 1024), (4, 12, 1024), (1, 12, 100), (8, 2, 40)]:
        parts = partitions(num_seqs, heads, max_keys, DEVICE, config)
        assert 1 < parts <= 16 and (parts - 1) * 32 < max_keys  # no partition is empty at the widest context
        assert num_seqs * heads * parts >= 264 or parts == 16 or parts * 32 >= max_keys
    assert partitions(17, 16, 1024, DEVICE, config) == partitions(264, 1, 1024, DEVICE, config) == 1  # enough pairs


def poisoned_cache(layout: str, num_blocks: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[NB, bs, H, D] of NaN (an 8-bit cache: POISON bytes), stored as `layout` says: a slot the kernel missed or
    wrongly wrote shows."""
    if layout == "head-major":
        cache = paged_cache(blocks=num_blocks, block_size=block_size, heads=H, head_dim=D, dtype=dtype)
    else:
        cache = torch.empty((num_blocks, block_size, H, D), dtype=dtype)
    if dtype.itemsize == 1:
        as_bytes(cache).view(torch.uint8).fill_(POISON)
        return cache.to(DEVICE)
    return cache.fill_(float("nan")).to(DEVICE)  # keeps the strides


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_store_kernel_writes_every_slot_and_nothing_else(layout, block_size, dtype):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, T = 12, 2 * block_size + 3
    projection = torch.randn((T, 3 * H * D), generator=gen).to(DEVICE, dtype)  # [T, 3C] as c_attn returns it
    k, v = (projection[:, i * H * D : (i + 1) * H * D].view(T, H, D) for i in (1, 2))  # strided views
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T].to(DEVICE)  # scattered over blocks
    caches = [poisoned_cache(layout, num_blocks, block_size, dtype) for _ in (k, v)]  # [NB, bs, H, D] each
    expected = [c.clone() for c in caches]
    store(LayerKV(*expected), k, v, slots)
    store_kv(LayerKV(*caches), k, v, slots)
    for cache, want, new in zip(caches, expected, (k, v)):
        torch.testing.assert_close(cache, want, atol=0, rtol=0, equal_nan=True)  # a copy: exact
        assert torch.equal(cache.reshape(-1, H, D)[slots], new)  # every row in its slot
        assert cache.isnan().sum() == (num_blocks * block_size - T) * H * D  # every other slot untouched


def quantized_cache(values: torch.Tensor, live: torch.Tensor, cache_dtype: torch.dtype) -> tuple[LayerKV, list]:
    """Float keys and values [2, NB, bs, H, D] quantized into paged_cache's layout with paged_scales' beside, every
    slot outside `live` ([NB*bs] bool) poisoned, data and scale; and the dequantized caches the kernel must attend
    over (in the values' dtype, NaN in the poisoned slots)."""
    _, NB, bs, _, _ = values.shape
    stored, dequantized = [], []
    for x in values:
        data, scale = quantize(x.reshape(-1, H, D), cache_dtype)  # [NB*bs, H, D], [NB*bs, H]
        as_bytes(data).view(torch.uint8)[~live] = POISON
        scale[~live] = float("nan")
        cache = paged_cache(blocks=NB, block_size=bs, heads=H, head_dim=D, dtype=cache_dtype)
        as_bytes(cache).view(-1, H, D).copy_(as_bytes(data))
        scales = paged_scales(blocks=NB, block_size=bs, heads=H, device="cpu")
        scales.view(-1, H).copy_(scale)
        stored += [cache.to(DEVICE), scales.to(DEVICE)]  # keeps the strides
        dequantized.append(dequantize(data, scale, values.dtype).view(NB, bs, H, D))
    k, k_scale, v, v_scale = stored
    return LayerKV(k, v, k_scale, v_scale), dequantized


def live_slots(seqs: list[Sequence], num_blocks: int, block_size: int) -> torch.Tensor:
    """[NB*bs] True at every slot holding a key of some sequence's context."""
    live = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for seq in seqs:
        positions = torch.arange(seq.num_computed_tokens + seq.num_scheduled_tokens)
        live[torch.tensor(seq.block_table)[positions // block_size] * block_size + positions % block_size] = True
    return live


def quantization_error(x: torch.Tensor, cache_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The most each element of float rows x [..., D] can move when stored in cache_dtype and read back in `dtype`.

    A row's scale s is max|x| / QMAX, and x / s lies within +-QMAX. int8 rounds x / s to an integer: at most half a
    step, s / 2 (the clamp to +-127 only trims the hair past 127 a division can leave). A float8 with m fraction bits
    rounds to nearest: at most half its spacing, 2^-(m+1) |x| for normal values (e4m3: 2^-4 |x|, e5m2: 2^-3 |x|),
    and half the subnormals' spacing, s * tiny * 2^-(m+1), below its smallest normal. Dequantized, the value is
    rounded to `dtype` too: at most its eps / 2 relative."""
    x = x.double()
    scale = x.abs().amax(-1, keepdim=True) / QMAX[cache_dtype]
    if cache_dtype == torch.int8:
        error = (scale / 2).expand_as(x)
    else:
        fp8 = torch.finfo(cache_dtype)  # eps = 2^-m
        error = torch.maximum(x.abs() * fp8.eps / 2, scale * fp8.tiny * fp8.eps / 2)
    return error + (x.abs() + error) * torch.finfo(dtype).eps / 2


ROWS = KernelConfig(split_target_programs=0, decode_block_m=1)  # decode rows alone: products on CUDA cores (tl.sum)
# Each kernel and path once: the tiled kernel's tl.dot over chunks and decodes, its one-row tiles over decodes (block
# size 4: several blocks per loop iteration), the split kernel over partitions some of which are empty
QUANTIZED_KERNELS = {
    "tiles": (UNSPLIT, SHAPES["chunks"], 16),
    "rows": (ROWS, SHAPES["decodes"], 4),
    "split": (SPLIT, SPLIT_SHAPES["short and long"], 16),
}


@pytest.mark.parametrize("dtype", TOLERANCE)
@pytest.mark.parametrize("kernel", QUANTIZED_KERNELS)
@pytest.mark.parametrize("cache", QUANTIZED)
def test_kernel_over_a_quantized_cache(cache, kernel, dtype):
    skip_interpreted_bfloat16(dtype)
    config, shapes, block_size = QUANTIZED_KERNELS[kernel]
    cache_dtype, num_blocks = CACHE_DTYPES[cache], 200
    seqs = scheduled(block_size, num_blocks=num_blocks, shapes=shapes, seed=len(shapes))
    gen = torch.Generator().manual_seed(block_size)
    values = torch.randn((2, num_blocks, block_size, H, D), generator=gen).to(dtype)  # keys and values
    layer, dequantized = quantized_cache(values, live_slots(seqs, num_blocks, block_size), cache_dtype)
    rows = sum(s.num_scheduled_tokens for s in seqs)
    q = torch.randn((rows, 3 * H * D), generator=gen).to(DEVICE, dtype)[:, : H * D].view(rows, H, D)  # strided
    paged = build_step_inputs(seqs, block_size, DEVICE).paged
    parts = partitions(len(seqs), H, paged.block_tables.shape[1] * block_size, DEVICE, config)
    assert (parts > 1) == (kernel == "split") and (config.decode_block_m == 1) == (kernel == "rows")
    got = TritonAttention(paged, config).attend(q, layer).double().cpu()
    q = q.cpu()
    # (a) the values stored, times their scales, are what it attends over: the float kernels' tolerance
    expected = dense_attention(q, *dequantized, seqs, block_size)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # (b) against the float cache: within what quantization can move attention (dense_attention's bound from each
    # element's quantization_error; on random data int8's errors reach ~3/4 of it, where a row sees one key and its
    # error is its value's alone, float8's under a tenth), plus the float kernels' tolerance for their arithmetic
    errors = [quantization_error(x, cache_dtype, dtype) for x in values]
    expected, bound = dense_attention(q, *values, seqs, block_size, errors)
    excess = (got - expected).abs() - bound - TOLERANCE[dtype] * (1 + expected.abs())
    assert excess.max() <= 0, f"{(excess > 0).sum()} values past the bound, by up to {excess.max():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cache", QUANTIZED)
def test_store_kernel_quantizes_as_quantize_and_writes_nothing_else(cache, layout, dtype):
    """Every slot's values and scales as model.attention.quantize gives them (PyTorch's on the CPU: IEEE division and
    rounding to nearest even, which the kernel computes too); every other slot's poisoned bytes and NaN scales left."""
    cache_dtype, block_size, num_blocks = CACHE_DTYPES[cache], 4, 12
    gen = torch.Generator().manual_seed(len(cache))
    T = 2 * block_size + 3
    projection = torch.randn((T, 3 * H * D), generator=gen) * torch.rand((T, 1), generator=gen).exp2()  # [T, 3C]
    projection[0, H * D : 2 * H * D] = tie_rows(cache_dtype)  # row 0's keys: halfway between two stored values
    projection[:2, 2 * H * D :] = 0  # rows 0 and 1's values: zero rows (scale 1)
    projection = projection.to(DEVICE, dtype)
    k, v = (projection[:, i * H * D : (i + 1) * H * D].view(T, H, D) for i in (1, 2))  # strided views
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T].to(DEVICE)  # scattered over blocks
    caches = [poisoned_cache(layout, num_blocks, block_size, cache_dtype) for _ in range(2)]
    scales = [poisoned_scales(layout, num_blocks, block_size) for _ in range(2)]
    expected = [c.cpu().clone() for c in caches + scales]  # [k, v, k_scale, v_scale], strided as they are
    store(LayerKV(*expected), k.cpu(), v.cpu(), slots.cpu())
    store_kv(LayerKV(*caches, *scales), k, v, slots)
    for got, want in zip(caches, expected[:2]):
        assert torch.equal(as_bytes(got).cpu().view(torch.uint8), as_bytes(want).view(torch.uint8)), "bit for bit"
    for got, want in zip(scales, expected[2:]):
        torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0, equal_nan=True)
    for data, scale in ((caches[0], scales[0]), (caches[1], scales[1])):
        assert (as_bytes(data).view(torch.uint8) == POISON).sum() >= (num_blocks * block_size - T) * H * D
        assert scale.isnan().sum() == (num_blocks * block_size - T) * H  # every other slot's untouched
    assert (scales[1].reshape(-1, H)[slots[:2]] == 1).all()  # a zero row's scale


def tie_rows(cache_dtype: torch.dtype) -> torch.Tensor:
    """[H*D] rows whose largest value is QMAX (so their scale is 1, and x / scale exact), the others each halfway
    between two neighbours of the stored dtype's grid, positive and negative, subnormals included: where rounding
    to nearest even and to nearest away from zero part."""
    if cache_dtype == torch.int8:
        grid = torch.arange(-127, 128, dtype=torch.float64)
    else:
        grid = torch.arange(256, dtype=torch.uint8).view(cache_dtype).double()
        grid = grid[grid.isfinite() & (grid.abs() <= QMAX[cache_dtype])].unique()  # sorted
    halfway = (grid[:-1] + grid[1:]) / 2
    picked = halfway[torch.linspace(0, len(halfway) - 1, H * (D - 1)).round().long()].view(H, D - 1)
    return torch.cat([torch.full((H, 1), QMAX[cache_dtype], dtype=torch.float64), picked], dim=1).flatten().float()


def poisoned_scales(layout: str, num_blocks: int, block_size: int) -> torch.Tensor:
    """[NB, bs, H] float32 of NaN, as paged_scales lays them out (head-major) or token by token."""
    if layout == "head-major":
        scales = paged_scales(blocks=num_blocks, block_size=block_size, heads=H, device="cpu")
    else:
        scales = torch.empty((num_blocks, block_size, H))
    return scales.fill_(float("nan")).to(DEVICE)


def test_batch_ladder_and_bucket_choice(tiny_checkpoint):
    assert batch_ladder(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert batch_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert batch_ladder(1) == [1]
    engine = make_engine(tiny_checkpoint, attention="triton", graphs="eager", max_batch_size=20)
    graphs = engine.runner.graphs
    assert [graphs.bucket(n) for n in (1, 2, 3, 5, 9, 16, 17, 20)] == [1, 2, 4, 8, 16, 16, 20, 20]


def test_static_buffers_hold_the_rows_then_padding_to_the_scratch_block(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=64, block_size=4, attention="triton", graphs="eager")
    graphs, scratch = engine.runner.graphs, 64
    seqs = [Sequence(p, SamplingParams(max_tokens=4, temperature=0)) for p in random_prompts([3, 9, 14], seed=30)]
    for seq in seqs:
        engine.add(seq)
    engine.step()  # prefill, eagerly
    for seq in engine.scheduler.schedule():
        assert seq.num_scheduled_tokens == 1
    assert graphs.fits(seqs) and graphs.bucket(3) == 4
    graphs.prepare(seqs)
    positions = [len(s.token_ids) - 1 for s in seqs]
    assert graphs.input_ids[:4].tolist() == [s.token_ids[-1] for s in seqs] + [0]
    assert graphs.positions[:4].tolist() == positions + [0]
    assert graphs.context_lens[:4].tolist() == [p + 1 for p in positions] + [1]
    slots = [s.block_table[p // 4] * 4 + p % 4 for s, p in zip(seqs, positions)]
    assert graphs.slot_mapping[:4].tolist() == slots + [scratch * 4]
    assert graphs.block_tables[3, 0] == scratch
    for row, seq in enumerate(seqs):
        assert graphs.block_tables[row, : len(seq.block_table)].tolist() == seq.block_table


GRAPH_MODES = ["off", "eager"] + (["capture"] if torch.cuda.is_available() else [])
# Under the interpreter an engine's run takes half a minute: there each graph mode runs once, the static buffers
# with the prefix cache (hits and recomputes feeding them), the plain path without. A GPU run takes every pair.
GREEDY_CASES = [
    (graphs, prefix_cache)
    for graphs in GRAPH_MODES
    for prefix_cache in (True, False)
    if torch.cuda.is_available() or prefix_cache == (graphs != "off")
]


@pytest.mark.parametrize(("graphs", "prefix_cache"), GREEDY_CASES)
def test_greedy_output_through_the_kernel_equals_transformers(tiny_checkpoint, hf_greedy, graphs, prefix_cache):
    engine = make_engine(
        tiny_checkpoint,
        num_blocks=40,  # tight: sequences are preempted and recomputed
        block_size=4,
        attention="triton",
        graphs=graphs,
        max_batch_tokens=24,  # prompts are chunked
        max_batch_size=6,  # a ladder of 1, 2, 4, 6
        prefix_cache=prefix_cache,
    )
    check_greedy_under_pressure(engine, hf_greedy)
    decode_steps = [r for r in engine.step_log.since(0) if r.num_prefills == 0]
    assert len(decode_steps) > 10
    if graphs != "off":  # every pure decode step ran from the static buffers (or their graphs)
        assert engine.runner.graphs.num_replays == len(decode_steps)
        assert engine.num_steps_ahead > 0  # some launched before the step in front of them was read


# Under the interpreter an engine's run over a quantized cache takes seconds a step: int8 alone there (the kernels'
# tests above cover each dtype; this one, that the graphs' path reaches them with the scales). A GPU run takes each.
@pytest.mark.parametrize("cache", QUANTIZED if torch.cuda.is_available() else ["int8"])
def test_graphs_replay_the_quantized_cache(tiny_checkpoint, cache):
    """Decode steps from the graphs (captured on a GPU; their static buffers on a CPU, padded from 3 rows to 4) store
    into and attend over the model's quantized cache: the greedy tokens of the reference backend over the same
    cache dtype."""
    (prefix,) = random_prompts([9], seed=40)
    prompts = random_prompts([3, 12, 5], seed=41, prefix=prefix)  # a shared prefix: cached blocks, their scales
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (5, 3, 5)]
    outputs = {}
    for attention, graphs in [("reference", "off"), ("triton", "capture" if torch.cuda.is_available() else "eager")]:
        engine = quantized_engine(tiny_checkpoint, cache, attention, graphs)
        outputs[attention] = engine.generate(prompts, params)
        assert engine.runner.model.kv_cache[0].k.dtype == CACHE_DTYPES[cache]
    assert engine.runner.graphs.num_replays > 0
    assert outputs["triton"] == outputs["reference"]


def quantized_engine(checkpoint, cache: str, attention: str, graphs: str) -> Engine:
    """A float32 engine over a KV_CACHE_DTYPE=`cache` pool: the Triton backend on the GPU if there is one."""
    device = DEVICE if attention == "triton" else torch.device("cpu")
    loaded = load_model(str(checkpoint), device, torch.float32)
    settings = EngineSettings(block_size=4, kv_cache_dtype=cache, max_batch_size=4)
    runner = ModelRunner(loaded.model, 48, 4, attention, graphs, 4, cache_dtype=CACHE_DTYPES[cache])
    return Engine(runner, 48, settings, loaded.name)


def test_backend_and_graphs_follow_the_settings_and_the_device():
    from config import EngineSettings
    from generate.model_runner import ModelRunner
    from model.gpt2 import GPT, GPTConfig

    def runner(n_embd: int, **settings) -> ModelRunner:
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=n_embd, n_positions=64, vocab_size=100))
        return ModelRunner.from_settings(model, 8, EngineSettings(block_size=4, **settings))

    on_cpu = runner(32)
    assert on_cpu.attention in ("cpu", "reference") and on_cpu.graphs is None  # auto: the Triton kernel is for CUDA
    if not torch.cuda.is_available():  # a model on CPU runs the kernel under the interpreter only
        assert runner(32, attention_backend="triton").attention == "triton"
    with pytest.raises(ValueError, match="power of two, not 48"):
        runner(96, attention_backend="triton")
