"""The Triton paged-attention kernel against dense attention, and the CUDA-graph runner's static buffers.

Without a GPU both run on CPU: the kernel under Triton's interpreter (conftest sets
TRITON_INTERPRET=1), the graph runner with capture off. A GPU run covers the compiled kernel
and graph capture and replay.
"""

import pytest
import torch
from conftest import random_prompts
from test_model import make_engine

pytest.importorskip("triton", reason="the Triton kernel needs the triton package")

from generate.cuda_graphs import batch_ladder  # noqa: E402
from generate.sequence import SamplingParams, Sequence  # noqa: E402
from generate.step_input import build_step_inputs, reference_groups  # noqa: E402
from model.attention import ReferenceAttention  # noqa: E402
from model.triton_attention import TritonAttention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
H, D = 4, 64  # GPT-2's head dimension
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def scheduled(block_size: int, num_blocks: int, shapes: list[tuple[int, int]], seed: int) -> list[Sequence]:
    """Sequences with `context` tokens of which the last `chunk` are scheduled, over shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for chunk, context in shapes:
        seq = Sequence([1] * context)
        needed = -(-context // block_size)
        seq.block_table, free = free[:needed], free[needed:]
        seq.num_computed_tokens, seq.num_scheduled_tokens = context - chunk, chunk
        seqs.append(seq)
    return sorted(seqs, key=lambda s: s.num_scheduled_tokens == 1)  # chunks first, as the engine orders them


def dense_attention(q, k_cache, v_cache, seqs, block_size) -> torch.Tensor:
    """Causal attention of each sequence's rows over its keys, in float64, written from scratch."""
    outputs, row = [], 0
    for seq in seqs:
        n, context = seq.num_scheduled_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
        blocks = torch.tensor(seq.block_table)
        k = k_cache[blocks].reshape(-1, H, D)[:context].double()  # [context, H, D]
        v = v_cache[blocks].reshape(-1, H, D)[:context].double()
        scores = torch.einsum("qhd,khd->hqk", q[row : row + n].double(), k) / D**0.5
        query_pos = torch.arange(context - n, context)
        scores = scores.masked_fill(torch.arange(context)[None, None, :] > query_pos[None, :, None], float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, H * D))
        row += n
    return torch.cat(outputs)


SHAPES = {
    "decodes": [(1, 1), (1, 15), (1, 16), (1, 17), (1, 64), (1, 300)],
    "full context": [(1, 1024), (1, 2)],
    "chunks": [(7, 7), (16, 32), (33, 40), (5, 16), (1, 9), (1, 48)],
    "whole prompt": [(1024, 1024)],
}


CASES = [
    (shapes, dtype, block_size)
    for shapes in SHAPES
    for dtype in TOLERANCE
    for block_size in (16, 4)
    if shapes != "whole prompt" or (block_size == 16 and dtype != torch.bfloat16)  # slow under the interpreter
]


@pytest.mark.parametrize(("shapes", "dtype", "block_size"), CASES)
def test_kernel_equals_dense_attention(shapes, dtype, block_size):
    if dtype == torch.bfloat16 and not torch.cuda.is_available() and shapes in ("chunks", "whole prompt"):
        pytest.skip("Triton's interpreter gets tl.dot of bfloat16 wrong (numpy has no bfloat16): a GPU run checks it")
    seqs = scheduled(block_size, num_blocks=600, shapes=SHAPES[shapes], seed=len(shapes))
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn((600, block_size, H, D), generator=gen).to(DEVICE, dtype) for _ in range(2)]
    rows = sum(s.num_scheduled_tokens for s in seqs)
    q = torch.randn((rows, 3 * H * D), generator=gen).to(DEVICE, dtype)[:, : H * D].view(rows, H, D)  # strided
    expected = dense_attention(q.cpu(), *(c.cpu() for c in caches), seqs, block_size)
    paged = build_step_inputs(seqs, block_size, DEVICE).paged
    got = TritonAttention(paged).attend(q, *caches).double().cpu()
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    if dtype == torch.float32:  # the reference backend agrees with the same oracle
        reference = ReferenceAttention(reference_groups(seqs, block_size, DEVICE), space=make_space())
        torch.testing.assert_close(reference.attend(q, *caches).double().cpu(), expected, atol=1e-5, rtol=1e-5)


def make_space():
    from model.attention import GatherSpace

    return GatherSpace()


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


@pytest.mark.parametrize("graphs", GRAPH_MODES)
@pytest.mark.parametrize("prefix_cache", [True, False])
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
    (prefix,) = random_prompts([13], seed=31)
    prompts = random_prompts([1, 30, 7, 50, 4, 18, 2], seed=32, prefix=prefix)
    counts = [20, 9, 30, 12, 25, 16, 22]
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in counts])
    assert outputs == [hf_greedy(p, n) for p, n in zip(prompts, counts)]
    assert engine.scheduler.num_preemptions > 0
    engine.blocks.check_integrity([])
    decode_steps = [r for r in engine.step_log.since(0) if r.num_prefills == 0]
    assert len(decode_steps) > 10
    if graphs != "off":  # every pure decode step ran from the static buffers (or their graphs)
        assert engine.runner.graphs.num_replays == len(decode_steps)


def test_backend_and_graphs_follow_the_settings_and_the_device():
    from config import Settings
    from generate.model_runner import ModelRunner
    from model.gpt2 import GPT, GPTConfig

    def runner(n_embd: int, **settings) -> ModelRunner:
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=n_embd, n_positions=64, vocab_size=100))
        return ModelRunner.from_settings(model, 8, Settings(block_size=4, **settings))

    on_cpu = runner(32)
    assert on_cpu.attention == "reference" and on_cpu.graphs is None  # auto: the kernel is for CUDA
    if not torch.cuda.is_available():  # a model on CPU runs the kernel under the interpreter only
        assert runner(32, attention_backend="triton").attention == "triton"
    with pytest.raises(ValueError, match="power of two, not 48"):
        runner(96, attention_backend="triton")
