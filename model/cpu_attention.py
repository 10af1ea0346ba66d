"""Paged attention on a CPU, in C++ (model/cpu_attention.cpp): queries read their keys and values through the
block tables in place, as the Triton kernel does on a GPU and vLLM's CPU kernels do on a CPU.

The reference backend copies each sequence's cache blocks out (index_select), then reads them again in two
matrix products: at batch 64 and a few hundred tokens of context the cache is most of what a decode step
reads, and it is read three times. This kernel reads it once. torch builds it on first use with the C++
compiler and ninja (`torch.utils.cpp_extension`), for this machine's instruction set, into torch's
extension cache; where that cannot happen, `available()` says why and the engine keeps the reference.
"""

import hashlib
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

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
        return torch.ops.gpt2_cpu.paged_attention(
            q, k_cache, v_cache, p.query_start, p.context_lens, p.block_tables, scale
        )
