"""Paged attention in Triton: queries read their keys and values through the block tables, in place.

One program per (sequence, head, tile of up to BLOCK_M query rows). It walks the sequence's
cache BLOCK_N keys at a time, finding each key's block in the block table, with an online
softmax (running max and sum), so no key is copied, nothing is padded to the longest
context, and a chunk of new tokens attends causally over the cache and itself. Context
lengths and query offsets are read from tensors, so a CUDA graph can replay it on new values.
Under TRITON_INTERPRET=1 it runs on CPU tensors (slowly), which is how CI checks it.

Triton compiles one variant per constexpr and per specialisation of the other arguments (a pointer
divisible by 16 or not, an integer equal to 1 or divisible by 16). So the step's inputs are uploaded
16-byte aligned (generate/step_input.py), `stride_bt` (the block tables' width, which changes with
the longest context in a step) is not specialised on, and the engine warms both BLOCK_M variants
before the server reports ready: nothing compiles while serving.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from model.attention import PagedInputs, store


@triton.jit
def _scores(q, k, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
    """[BM, D] x [BN, D] -> [BM, BN] in float32."""
    if BLOCK_M >= 16:  # tensor cores need 16 rows
        return tl.dot(q, tl.trans(k), input_precision=PRECISION)
    return tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _weighted(p, v, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
    """[BM, BN] probabilities x [BN, D] values -> [BM, D] in float32."""
    if BLOCK_M >= 16:
        return tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)


@dataclass(frozen=True)
class KernelConfig:
    """The kernel's tuning knobs. DEFAULT is what the engine runs; `benchmarks/decode_step.py --sweep`
    times the alternatives on the device at hand."""

    # Chosen by the sweep on an H200 (gpt2-medium, float16, context 200; docs/gpu.md): one layer's decode
    # attention at batch 128 took 38 us against 136 us with one row per program, 4 warps and 64 keys (at 256,
    # 71 against 262 us). Masking 15 of 16 rows costs less than leaving the tensor cores idle.
    block_n: int = 32  # keys per loop iteration
    num_warps: int = 2
    decode_block_m: int = 16  # query rows per program when every sequence decodes one; 16 takes tl.dot's path
    chunk_block_m: int = 16  # ... when some sequence computes a chunk: tensor cores need 16 rows
    table_dtype: torch.dtype = torch.int64  # block-table entries as the kernel reads them


DEFAULT = KernelConfig()


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention(
    Q, K, V, Out, query_start, context_lens, block_tables,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
    scale,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    seq, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start + seq)
    q_len = tl.load(query_start + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        context = tl.load(context_lens + seq)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows within the sequence's run
        dims = tl.arange(0, HEAD_DIM)
        real = rows < q_len
        query_pos = context - q_len + rows  # [BM] each query's position: it sees keys 0..query_pos
        q_ptr = Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
        q = tl.load(q_ptr, mask=real[:, None], other=0.0)
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        key_end = tl.minimum(context, context - q_len + (tile + 1) * BLOCK_M)  # what the tile's last row sees
        for first in range(0, key_end, BLOCK_N):
            keys = first + tl.arange(0, BLOCK_N)
            present = keys < key_end
            block = tl.load(block_tables + seq * stride_bt + keys // BLOCK_SIZE, mask=present, other=0)
            offset = block[:, None] * stride_kb + (keys % BLOCK_SIZE)[:, None] * stride_ks + head * stride_kh
            k = tl.load(K + offset + dims[None, :], mask=present[:, None], other=0.0)  # [BN, D]
            v = tl.load(V + offset + dims[None, :], mask=present[:, None], other=0.0)  # [BN, D]
            s = _scores(q, k, BLOCK_M, PRECISION) * scale  # [BM, BN]
            # causal, which also hides absent keys: every real row sees key 0, so no row is all -inf
            s = tl.where(keys[None, :] <= query_pos[:, None], s, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(s, axis=1))
            p = tl.exp(s - new_max[:, None])  # [BM, BN]
            rescale = tl.exp(running_max - new_max)
            running_sum = running_sum * rescale + tl.sum(p, axis=1)
            acc = acc * rescale[:, None] + _weighted(p, v, BLOCK_M, PRECISION)
            running_max = new_max
        out = acc / running_sum[:, None]
        out_ptr = Out + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
        tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=real[:, None])


class TritonAttention:
    """The step's attention through the Triton kernel; `paged` may be a CUDA graph's static buffers."""

    store = staticmethod(store)

    def __init__(self, paged: PagedInputs, config: KernelConfig = DEFAULT):
        self.paged, self.config = paged, config
        tables = paged.block_tables
        self.block_tables = tables if tables.dtype == config.table_dtype else tables.to(config.table_dtype)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        T, H, D = q.shape
        _, block_size, _, _ = k_cache.shape
        assert k_cache.stride(3) == 1 and q.stride(2) == 1 and k_cache.stride() == v_cache.stride()
        paged, config, tables = self.paged, self.config, self.block_tables
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)  # [T, H, D]
        block_m = config.decode_block_m if paged.max_query_len == 1 else config.chunk_block_m
        num_seqs = paged.context_lens.shape[0]
        grid = (num_seqs, H, triton.cdiv(paged.max_query_len, block_m))
        _paged_attention[grid](
            q, k_cache, v_cache, out, paged.query_start, paged.context_lens, tables,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
            D**-0.5,
            BLOCK_SIZE=block_size, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=config.block_n,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps,
        )  # fmt: skip
        return out.view(T, H * D)  # [T, C]
