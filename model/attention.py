"""Attention over the paged KV cache: one interface, two backends.

A step's attention object is built by the engine from the scheduled sequences and called
by every layer: `attend(q, k_cache, v_cache)` returns each query row's attention output.
  reference  gathers each sequence's cache blocks into a dense buffer and attends with two
             batched matrix products and a mask: plain PyTorch, any device, the oracle;
  triton     (model/triton_attention.py) reads keys and values through the block tables in
             place, with an online softmax: no gather, no padding to the longest context;
  cpu        (model/cpu_attention.py) the same in C++ on a CPU, built on first use.

A layer's cache (LayerKV) holds keys and values in the model's dtype, or quantized (KV_CACHE_DTYPE int8 or
fp8): 8 bits a value, with one float32 scale per token and head kept beside each block, so that whatever
moves a block (the prefix trie, a fork, eviction, preemption) moves its scales with it. Every backend
quantizes as it stores (`quantize`) and reads values times their row's scale.
"""

import math
import mmap
from dataclasses import dataclass
from typing import Protocol

import torch

BACKENDS = ("reference", "triton", "cpu")
# KV_CACHE_DTYPE's names (vLLM's --kv-cache-dtype) and what each stores; auto: the model's own dtype. fp8 is e4m3.
CACHE_DTYPES = {
    "auto": None,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# The largest magnitude each quantized dtype holds: a row's scale maps its largest value there.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@dataclass(slots=True)
class LayerKV:
    """One layer's paged keys and values. Quantized, a stored row is round(x / scale) in 8 bits, its scale
    max|x| / QMAX over the row's head dimension (symmetric, per token and head: computed as each token is
    stored, so nothing is calibrated), and a reader takes stored * scale."""

    k: torch.Tensor  # [NB, bs, H, D] keys: the model's dtype, or int8 / float8
    v: torch.Tensor  # [NB, bs, H, D] values, as k
    k_scale: torch.Tensor | None = None  # [NB, bs, H] float32, each key row's scale; None: not quantized
    v_scale: torch.Tensor | None = None  # [NB, bs, H] float32, each value row's

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


class StepAttention(Protocol):
    fused_norms: bool  # the model runs each residual add and the LayerNorm after it as one Triton kernel

    def store(
        self,
        cache: LayerKV,  # this layer's keys and values
        k: torch.Tensor,  # [T, H, D] the step's new keys
        v: torch.Tensor,  # [T, H, D]
        slots: torch.Tensor,  # [T] where each goes: block * bs + offset
    ) -> None: ...

    def attend(
        self,
        q: torch.Tensor,  # [T, H, D] the step's queries, flat over sequences
        cache: LayerKV,  # this layer's keys and values, the step's new ones already stored
    ) -> torch.Tensor: ...  # [T, H*D]


@dataclass(slots=True)
class PagedInputs:
    """Where each sequence's queries and keys are: what a paged kernel reads, and CUDA graphs replay."""

    query_start: torch.Tensor  # [B+1] int64: sequence i's query rows are query_start[i]..query_start[i+1]-1
    context_lens: torch.Tensor  # [B] int64: keys each sequence attends over (its cache up to its last query)
    block_tables: torch.Tensor  # [B, W] int64: each sequence's cache blocks, padded
    max_query_len: int  # the longest run of query rows (1 in a decode-only step), for the kernel's grid


@dataclass(slots=True)
class AttentionGroup:
    """Sequences of one step that attend together, padded to a common shape.

    Sequences with several new tokens (prompt chunks) and single-token rows group apart, and
    each by context length, so a 500-token chunk never pads 100 decodes and one 1000-token
    context never pads 100 short ones.
    """

    query_index: torch.Tensor  # [B, Lq] flat row of each query (padding points at row 0)
    key_blocks: torch.Tensor  # [B, nb] cache blocks holding each sequence's keys (padding: block 0)
    mask: torch.Tensor  # [B, 1, Lq, Lk] True where the query may attend; Lk = nb * block size
    valid_rows: torch.Tensor | None  # [N] rows of the [B*Lq] padded output that are real (None: all)
    out_rows: torch.Tensor  # [N] the step's rows those outputs are


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] -> (round(x / scale) in `dtype` [T, H, D], scale [T, H] float32), scale = max|x| / QMAX over
    each row's head dimension (a row of zeros: scale 1). The kernels compute the same, in their own code."""
    scale = x.abs().amax(dim=-1).float() / QMAX[dtype]  # [T, H]
    scale = torch.where(scale > 0, scale, 1.0)  # [T, H]
    y = x.float() / scale[..., None]  # [T, H, D] within +-QMAX
    if dtype == torch.int8:
        y = y.round_().clamp_(-127, 127)  # the division can land a hair past 127
    return y.to(dtype), scale


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [..., D] times their scales [...] in float32, then in `dtype`: what a reader attends over."""
    return (x.float() * scale[..., None]).to(dtype)


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """An 8-bit cache as uint8, for indexed reads and writes: torch has those for every integer type, not for
    float8 on a CPU. Other dtypes as they are."""
    return x.view(torch.uint8) if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else x


def store(cache: LayerKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """The step's new keys and values into their cache slots (StepAttention.store), as indexed writes."""
    _, _, H, D = cache.k.shape
    if not cache.quantized:
        cache.k.view(-1, H, D)[slots] = k  # [NB*bs, H, D] view of the cache
        cache.v.view(-1, H, D)[slots] = v
        return
    for data, scales, x in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
        stored, scale = quantize(x, data.dtype)  # [T, H, D], [T, H]
        as_bytes(data).view(-1, H, D)[slots] = as_bytes(stored)
        scales.view(-1, H)[slots] = scale  # [NB*bs, H] view


def paged_cache(
    *leading: int,
    blocks: int,
    block_size: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Keys or values as [..., NB, bs, H, D], stored head by head within each leading index (a layer's
    keys, say): each head's block is one contiguous bs x D tile. The Triton kernel reads the view
    through its strides; the reference backend gathers whole tiles, which land as [H, B, Lk, D], ready
    for batched matrix products (from the token-major layout its products ran on strided operands,
    3-6x slower on a CPU). Zeros, as padding rows must read finite values."""
    shape = (*leading, heads, blocks, block_size, head_dim)
    return _zeros(shape, dtype, torch.device(device)).movedim(-4, -2)  # [..., NB, bs, H, D]


def paged_scales(*leading: int, blocks: int, block_size: int, heads: int, device: torch.device | str) -> torch.Tensor:
    """A quantized cache's scales as [..., NB, bs, H] float32, head by head as paged_cache lays out its values:
    each head's block one contiguous row of bs scales. Zeros: a padding row reads as zeros."""
    shape = (*leading, heads, blocks, block_size)
    return _zeros(shape, torch.float32, torch.device(device)).movedim(-3, -1)  # [..., NB, bs, H]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """On a CPU, zeros in an anonymous memory mapping: the OS gives each page zeroed when it is first
    written, so memory becomes resident as blocks come into use, not all at start (torch.zeros would
    write every page of a 4 GB pool). Private, not Python's default of shared: a shared mapping is
    shared memory to the kernel, whose first-write faults cost twice as much (a 256-token gpt2 prefill's
    stores, 2,304 faults: 5.3 ms shared, 3.1 ms private; bfloat16, AMD EPYC Zen 4)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    pages = mmap.mmap(-1, max(1, count * dtype.itemsize), flags=private)  # the tensor keeps it mapped
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


class GatherSpace:
    """One reusable pair of buffers for the keys/values each attention group copies out of the paged cache.

    On CPU a fresh tensor of tens of megabytes per layer and step costs more in page faults (the
    allocator hands big blocks back to the OS) than the copy itself: reusing one buffer makes the
    gather ~6x faster. The layers run one after another, so they can share it.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # flat, as large as any group's keys so far
        self.v: torch.Tensor | None = None

    def gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The blocks' keys and values, head by head: [H, n, bs, D] each (contiguous), from [NB, bs, H, D] caches."""
        _, bs, H, D = k_cache.shape
        shape = (H, blocks.numel(), bs, D)
        size = math.prod(shape)
        if self.k is None or self.k.numel() < size or self.k.dtype != k_cache.dtype or self.k.device != k_cache.device:
            self.k, self.v = k_cache.new_empty(size), k_cache.new_empty(size)
        k_out, v_out = self.k[:size].view(shape), self.v[:size].view(shape)
        k_heads, v_heads = k_cache.permute(2, 0, 1, 3), v_cache.permute(2, 0, 1, 3)  # [H, NB, bs, D]
        if not (k_heads.is_contiguous() and v_heads.is_contiguous()):  # not paged_cache's layout: a strided copy
            return torch.index_select(k_heads, 1, blocks, out=k_out), torch.index_select(v_heads, 1, blocks, out=v_out)
        # The tiles as rows of one matrix: index_select along its first dimension copies them in parallel,
        # 2-3x faster than along the second of four
        NB = k_heads.shape[1]
        rows = (torch.arange(H, device=blocks.device).unsqueeze(1) * NB + blocks).flatten()  # [H*n], for both
        k = torch.index_select(k_heads.reshape(H * NB, -1), 0, rows, out=k_out.view(rows.numel(), -1))
        v = torch.index_select(v_heads.reshape(H * NB, -1), 0, rows, out=v_out.view(rows.numel(), -1))
        return k.view(shape), v.view(shape)


@dataclass(slots=True)
class ReferenceAttention:
    groups: list[AttentionGroup]  # their out_rows cover the step's rows 0..T-1, each once
    space: GatherSpace
    store = staticmethod(store)
    fused_norms = False  # PyTorch's add, then nn.LayerNorm

    def attend(self, q: torch.Tensor, cache: LayerKV) -> torch.Tensor:
        outputs = [self._attend_group(q, cache, group) for group in self.groups]
        if len(outputs) == 1:
            return outputs[0]  # [T, C] one group holds every row, in order
        out = outputs[0].new_empty((q.shape[0], outputs[0].shape[1]))  # [T, C]
        for group, y in zip(self.groups, outputs):
            out[group.out_rows] = y
        return out

    def _attend_group(self, q, cache: LayerKV, group: AttentionGroup) -> torch.Tensor:
        """Attention written out as two batched products over the (head, sequence) pairs: on a CPU,
        scaled_dot_product_attention with a mask runs single-query rows 2-6x slower (in bfloat16 the
        most). The scores go through the softmax in float32, as transformers' eager attention does."""
        B, Lq = group.query_index.shape
        _, _, H, D = cache.k.shape
        blocks = group.key_blocks.flatten()  # [B*nb]
        # whole blocks: contiguous copies, far faster than per-key gathers
        k, v = self.space.gather(as_bytes(cache.k), as_bytes(cache.v), blocks)  # [H, B*nb, bs, D] each
        if cache.quantized:  # [H, NB, bs] scales of the same blocks
            k_scale, v_scale = (s.permute(2, 0, 1).index_select(1, blocks) for s in (cache.k_scale, cache.v_scale))
            k = dequantize(k.view(cache.k.dtype), k_scale, q.dtype)  # [H, B*nb, bs, D]
            v = dequantize(v.view(cache.v.dtype), v_scale, q.dtype)
        k, v = k.view(H * B, -1, D), v.view(H * B, -1, D)  # [H*B, Lk, D]
        q = (q[group.query_index] * D**-0.5).permute(2, 0, 1, 3).reshape(H * B, Lq, D)  # [H*B, Lq, D]
        scores = torch.bmm(q, k.transpose(1, 2)).view(H, B, Lq, -1).float()  # [H, B, Lq, Lk]
        scores.masked_fill_(group.mask.transpose(0, 1).logical_not(), -math.inf)  # mask [1, B, Lq, Lk]
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(H * B, Lq, -1)  # [H*B, Lq, Lk]
        y = torch.bmm(probs, v).view(H, B * Lq, D).transpose(0, 1).reshape(B * Lq, H * D)  # [B*Lq, C]
        return y if group.valid_rows is None else y[group.valid_rows]  # [rows, C]
