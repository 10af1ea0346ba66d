"""Paged attention on a CPU, in C++ (model/cpu_attention.cpp): queries read their keys and values through the
block tables in place, as the Triton kernel does on a GPU and vLLM's CPU kernels do on a CPU.

The reference backend copies each sequence's cache blocks out (index_select), then reads them again in two
matrix products: at batch 64 and a few hundred tokens of context the cache is most of what a decode step
reads, and it is read three times. This kernel reads it once. torch builds it on first use with the C++
compiler and ninja (`torch.utils.cpp_extension`), for this machine's instruction set, into torch's
extension cache; where that cannot happen, `available()` says why and the engine keeps the reference.

A prompt chunk's rows (LONG_RUN or more of one sequence) go instead to torch's fused attention on that
sequence's keys and values copied out once: there the copy is small beside the work, which blocked products
do faster than the kernel's one dot product per row and key.
"""

import hashlib
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from model.attention import PagedInputs
from model.cpu_features import cpu_flags

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_attention.cpp")


@cache
def build_problem() -> str | None:
    """Build (or load from torch's cache) the kernel; None once it is loaded, else why it cannot be."""
    from torch.utils import cpp_extension

    # -march=native: one build per instruction set (its name says which), never a Zen 4 build on a Zen 3
    flags = hashlib.sha1(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]
    try:
        cpp_extension.load(
            name=f"gpt2_cpu_attention_{flags}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native"],
            is_python_module=False,
        )
    except (OSError, RuntimeError, ImportError) as err:  # no compiler, no ninja, a failed build
        log.warning("the CPU attention kernel could not be built (%s): the reference backend it is", err)
        last = (str(err).strip().splitlines() or [""])[-1]  # a failed build's message ends with its cause
        return f"{type(err).__name__}: {last}"
    return None


def available() -> bool:
    return build_problem() is None


# From this many query rows of one sequence (a prompt chunk), torch's fused attention on its keys copied out
# beats the kernel: a 256-token prompt's attention 2.8 against 6.4 ms a layer (gpt2, 12 heads, Zen 3).
LONG_RUN = 32
HEAD_DIMS = (8, 16, 32, 64, 128)  # compiled in (cpu_attention.cpp's attend_any); GPT-2's is 64


def fits(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in (torch.float32, torch.bfloat16) and head_dim in HEAD_DIMS


@dataclass(slots=True)
class CpuAttention:
    paged: PagedInputs
    fused_norms = False  # PyTorch's add, then nn.LayerNorm

    @staticmethod
    def store(
        k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Each new key and value row copied to its slot (an indexed write into the head-major cache scatters
        element by element: 13 of a 300 ms step at batch 64)."""
        torch.ops.gpt2_cpu.store_kv(k_cache, v_cache, k, v, slots)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] (the head dimension contiguous), caches [NB, bs, H, D] -> [T, H*D]."""
        p = self.paged
        scale = q.shape[-1] ** -0.5
        if p.max_query_len < LONG_RUN:  # decodes and short chunks: the kernel takes every row
            return _kernel(q, k_cache, v_cache, p.query_start, p.context_lens, p.block_tables, scale)
        starts, lens = p.query_start.tolist(), p.context_lens.tolist()
        runs = [(b, starts[b], starts[b + 1]) for b in range(len(lens))]
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # [T, H*D]
        short = [run for run in runs if run[2] - run[1] < LONG_RUN]
        if short:
            rows = torch.cat([torch.arange(start, end) for _, start, end in short])  # [T_short]
            first = torch.tensor([0] + [end - start for _, start, end in short]).cumsum(0)  # [B_short+1]
            seqs = torch.tensor([b for b, _, _ in short])
            out[rows] = _kernel(q[rows], k_cache, v_cache, first, p.context_lens[seqs], p.block_tables[seqs], scale)
        for b, start, end in runs:
            if end - start >= LONG_RUN:
                out[start:end] = _dense(q[start:end], k_cache, v_cache, p.block_tables[b], lens[b], scale)
        return out


def _kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The C++ kernel over every row of q: [T, H, D] -> [T, H*D]."""
    return torch.ops.gpt2_cpu.paged_attention(q, k_cache, v_cache, query_start, context_lens, block_tables, scale)


def _dense(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, keys: int, scale: float
) -> torch.Tensor:
    """One sequence's run of query rows (the last of its `keys` positions, causal) by torch's fused attention on
    its keys and values copied out whole: [Lq, H, D] -> [Lq, H*D]."""
    Lq, H, D = q.shape
    blocks = table[: -(-keys // k_cache.shape[1])]  # [nb]
    # [NB, bs, H, D] -> [H, NB, bs, D] (the head-major cache's own order) -> [H, nb, bs, D] -> [H, keys, D]
    k, v = (cache.movedim(2, 0).index_select(1, blocks).flatten(1, 2)[None, :, :keys] for cache in (k_cache, v_cache))
    mask = torch.ones(Lq, keys, dtype=torch.bool).tril(keys - Lq)  # [Lq, keys]: row i sees keys up to its position
    # [1, H, ...]: torch's fused CPU kernel takes four dimensions (with three it falls back to plain products)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale)  # [1, H, Lq, D]
    return out[0].transpose(0, 1).reshape(Lq, H * D)
