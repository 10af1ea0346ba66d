"""The paged-attention kernel's tuning knobs, timed one layer's decode at a time (`decode_step.py --sweep`).

For each batch size, one layer's attention of a decode step — `batch` sequences, one query row each,
`context` keys each through shuffled block tables — runs under every combination of num_warps,
BLOCK_N, the decode tile (BLOCK_M=1: a row per program, reductions on CUDA cores; BLOCK_M=16: tl.dot
on tensor cores, 15 rows masked) and the block tables' integer width. A row gives microseconds per
call and the KV bytes it read per second (over a quantized cache, `cache_dtype` int8 or float8: the 8-bit
values and their float32 scales); `*` marks model/triton_attention.DEFAULT, what the engine runs. Under
TRITON_INTERPRET=1 on CPU it runs too (slowly), which is how a test checks the table.
"""

import itertools
import time
from dataclasses import replace

import torch

from generate.sequence import Sequence
from generate.step_input import build_step_inputs
from model.attention import LayerKV, PagedInputs, quantize
from model.gpt2 import GPTConfig
from model.triton_attention import DEFAULT, KernelConfig, TritonAttention

NUM_WARPS = (2, 4, 8)
BLOCK_N = (32, 64, 128)
DECODE_BLOCK_M = (1, 16)
TABLE_DTYPES = (torch.int32, torch.int64)
HEADER = "   | warps | BLOCK_N | BLOCK_M | table | batch | context |   us/call | KV GB/s"


def configs() -> list[KernelConfig]:
    """Every combination of the knobs, the default first."""
    grid = itertools.product(NUM_WARPS, BLOCK_N, DECODE_BLOCK_M, TABLE_DTYPES)
    swept = [replace(DEFAULT, num_warps=w, block_n=n, decode_block_m=m, table_dtype=t) for w, n, m, t in grid]
    return [DEFAULT, *(c for c in swept if c != DEFAULT)]


def decode_inputs(batch: int, context: int, block_size: int, device: torch.device) -> PagedInputs:
    """A decode step's inputs: every sequence at `context` keys, over shuffled blocks of a pool just large enough."""
    per_seq = -(-context // block_size)
    blocks = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(batch)).tolist()
    seqs = []
    for i in range(batch):
        seq = Sequence([1] * context)
        seq.block_table = blocks[i * per_seq : (i + 1) * per_seq]
        seq.num_computed_tokens, seq.num_scheduled_tokens = context - 1, 1
        seqs.append(seq)
    return build_step_inputs(seqs, block_size, device).paged


def time_call(attention: TritonAttention, q, cache: LayerKV, device: torch.device, repeats: int) -> float:
    """Mean seconds per call after one untimed call (which compiles)."""
    attention.attend(q, cache)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        attention.attend(q, cache)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def quantized(keys: torch.Tensor, values: torch.Tensor, cache_dtype: torch.dtype | None) -> LayerKV:
    """Keys and values [NB, bs, H, D] as they are, or quantized to `cache_dtype` with their scales [NB, bs, H]."""
    if cache_dtype is None:
        return LayerKV(keys, values)
    (k, k_scale), (v, v_scale) = (quantize(x.flatten(0, 1), cache_dtype) for x in (keys, values))
    shape = keys.shape
    return LayerKV(k.view(shape), v.view(shape), k_scale.view(shape[:3]), v_scale.view(shape[:3]))


def sweep(
    config: GPTConfig,
    batch_sizes: list[int],
    context: int,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
    block_size: int = 16,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """Print one row per knob combination and batch size, over a cache in `dtype` or quantized to `cache_dtype`."""
    H, D = config.n_head, config.head_dim
    print(HEADER)
    for batch in batch_sizes:
        paged = decode_inputs(batch, context, block_size, device)
        gen = torch.Generator().manual_seed(0)
        num_blocks = batch * -(-context // block_size)
        k, v = (torch.randn((num_blocks, block_size, H, D), generator=gen).to(device, dtype) for _ in range(2))
        cache = quantized(k, v, cache_dtype)  # token by token (not paged_cache's layout), as the sweeps so far
        q = torch.randn((batch, H, D), generator=gen).to(device, dtype)  # [B, H, D]
        kv_bytes = 2 * batch * context * H * (D * cache.k.element_size() + (4 if cache.quantized else 0))
        for c in configs():
            seconds = time_call(TritonAttention(paged, c), q, cache, device, repeats)
            mark = "*" if c == DEFAULT else " "
            table = str(c.table_dtype).removeprefix("torch.")
            print(
                f" {mark} | {c.num_warps:5} | {c.block_n:7} | {c.decode_block_m:7} | {table:5} | {batch:5} | "
                f"{context:7} | {1e6 * seconds:9.1f} | {kv_bytes / seconds / 1e9:8.2f}"
            )
