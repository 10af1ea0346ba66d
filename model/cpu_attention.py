"""Paged attention on a CPU, in C++ (model/cpu_attention.cpp): queries read their keys and values through the
block tables in place, as the Triton kernel does on a GPU and vLLM's CPU kernels do on a CPU.

The reference backend copies each sequence's cache blocks out (index_select), then reads them again in two
matrix products: at batch 64 and a few hundred tokens of context the cache is most of what a decode step
reads, and it is read three times. This kernel reads it once. torch builds it on first use with the C++
compiler and ninja (`torch.utils.cpp_extension`), for this machine's instruction set, into torch's
extension cache; where that cannot happen, `available()` says why and the engine keeps the reference.

With AVX-512 the kernel takes a prompt chunk's rows 16 at a time. Where that is not known to be the faster
(`long_run_for`: a CPU without AVX-512, whose kernel takes one dot product per row and key, or with AMX, not
compared there), a prompt chunk's rows (LONG_RUN or more of one sequence) go instead to torch's fused attention on
that sequence's keys and values copied out once: there the copy is small beside the work.

The cache is in the model's dtype or int8 (KV_CACHE_DTYPE=int8, model/attention.py's LayerKV): the kernel stores
rows quantized and reads them times their scales; a long run's copied blocks are dequantized first.
"""

import fcntl
import hashlib
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from model.attention import LayerKV, PagedInputs, dequantize
from model.cpu_features import cpu_flags

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_attention.cpp")


def extension_name() -> str:
    # -march=native: one build per instruction set (its name says which), never a Zen 4 build on a Zen 3
    return "gpt2_cpu_attention_" + hashlib.sha1(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]


def build_directory() -> Path:
    """Where torch builds and keeps the kernel (TORCH_EXTENSIONS_DIR, or its cache under the home directory)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(extension_name(), verbose=False))


@contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an flock on the build directory, and clear a torch lock left there by a killed build.

    torch's own lock is a file created with O_EXCL: a process killed while it builds or loads the kernel leaves
    it behind, and every later load waits on it forever (a server that never starts). An flock dies with its
    holder, and while we hold it no other process of ours is in cpp_extension.load, so a torch lock found then
    is stale.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # waits for a live build in another process, never for a dead one
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield


def cflags() -> list[str]:
    """-march=native, and -fopenmp where torch's threads are OpenMP's: the kernel then runs on them. Its
    GOMP calls bind to the libgomp torch has loaded (only compiled with -fopenmp, it links to none of its own)."""
    openmp = sys.platform == "linux" and torch.backends.openmp.is_available()
    return ["-O3", "-march=native"] + ["-fopenmp"] * openmp


@cache
def build_problem() -> str | None:
    """Build (or load from torch's cache) the kernel; None once it is loaded, else why it cannot be."""
    from torch.utils import cpp_extension

    try:
        with build_lock(build_directory()):
            cpp_extension.load(
                name=extension_name(), sources=[str(SOURCE)], extra_cflags=cflags(), is_python_module=False
            )
    except (OSError, RuntimeError, ImportError) as err:  # no compiler, no ninja, a failed build
        log.warning("the CPU attention kernel could not be built (%s): the reference backend it is", err)
        last = (str(err).strip().splitlines() or [""])[-1]  # a failed build's message ends with its cause
        return f"{type(err).__name__}: {last}"
    return None


def available() -> bool:
    return build_problem() is None


def long_run_for(flags: set[str]) -> int:
    """From how many query rows of one sequence (a prompt chunk) torch's fused attention, on its keys and values
    copied out, takes them from the kernel, on a CPU with these /proc/cpuinfo flags (sys.maxsize: never).

    Without AVX-512 the kernel computes a row's scores one key at a time, and flash attention's blocked products
    win from 32 rows: a 256-token prompt's attention 2.8 against 6.4 ms a layer (gpt2, 12 heads, Zen 3, float32).
    With AVX-512 the kernel takes 16 keys at a time, and on a Zen 4 (no AMX) it won at every length measured:
    a whole prompt's attention over gpt2's 12 layers (profiler), bfloat16, 136 tokens 6.8 against 10.6 ms (the copy
    included), 256: 19.1 against 27.4, 512: 59 against 88, 1,000: 214 against 302; float32, 136: 6.5 against 10.4,
    512: 75 against 91. Since then it takes a prompt chunk's rows 16 at a time (attend_rows16): 136 tokens 3.7 ms,
    256: 8.6, 1,000: 118. With AMX (Sapphire Rapids) torch's flash attention multiplies bfloat16 on its tiles, so
    there the long runs stay with it until the two are compared on such a CPU. (The vector form needs a head
    dimension that is a multiple of 32: every GPT-2 size's is 64.)"""
    if "avx512f" in flags and "amx_tile" not in flags:
        return sys.maxsize
    return 32


LONG_RUN = long_run_for(cpu_flags())
HEAD_DIMS = (8, 16, 32, 64, 128)  # compiled in (cpu_attention.cpp's attend_any); GPT-2's is 64


def fits(dtype: torch.dtype, head_dim: int, cache: torch.dtype | None = None) -> bool:
    """Whether the kernel computes in `dtype` over a cache of `cache` (None: the model's dtype)."""
    return dtype in (torch.float32, torch.bfloat16) and head_dim in HEAD_DIMS and cache in (None, torch.int8)


class LongRun(NamedTuple):
    """One sequence's run of LONG_RUN or more query rows, for torch's fused attention."""

    start: int  # its query rows are start..end-1 of the step's
    end: int
    blocks: torch.Tensor  # [nb] the cache blocks holding its keys
    keys: int  # how many: the rows are the last of these positions
    mask: torch.Tensor  # [Lq, keys] True where a row may attend (causal)


class Split(NamedTuple):
    """A step's rows parted between the kernel (decodes, short chunks) and torch's fused attention (long runs),
    worked out once for all its layers."""

    rows: torch.Tensor  # [T_short] the kernel's rows of the step
    query_start: torch.Tensor  # [B_short+1] over those rows
    context_lens: torch.Tensor  # [B_short]
    block_tables: torch.Tensor  # [B_short, W]
    long: list[LongRun]


def split(paged: PagedInputs, block_size: int) -> Split:
    """The step's sequences with fewer than LONG_RUN query rows for the kernel, the others one by one."""
    starts, lens = paged.query_start.tolist(), paged.context_lens.tolist()
    runs = [(b, starts[b], starts[b + 1]) for b in range(len(lens))]
    short = [b for b, start, end in runs if end - start < LONG_RUN]
    long = [
        long_run(start, end, paged.block_tables[b], lens[b], block_size)
        for b, start, end in runs
        if end - start >= LONG_RUN
    ]
    rows = [torch.arange(starts[b], starts[b + 1]) for b in short]
    first = torch.tensor([0] + [starts[b + 1] - starts[b] for b in short]).cumsum(0)  # [B_short+1]
    index = torch.tensor(short, dtype=torch.long)  # [B_short]
    return Split(torch.cat(rows) if rows else index, first, paged.context_lens[index], paged.block_tables[index], long)


def long_run(start: int, end: int, table: torch.Tensor, keys: int, block_size: int) -> LongRun:
    rows = end - start
    mask = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)  # [Lq, keys]: row i sees up to its position
    return LongRun(start, end, table[: -(-keys // block_size)], keys, mask)


@dataclass(slots=True)
class CpuAttention:
    paged: PagedInputs
    parts: Split | None = None  # the step's split, once a layer has needed it
    fused_norms = False  # PyTorch's add, then nn.LayerNorm

    @staticmethod
    def store(cache: LayerKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Each new key and value row copied to its slot (an indexed write into the head-major cache scatters
        element by element: 13 of a 300 ms step at batch 64), quantized on the way into an int8 cache."""
        torch.ops.gpt2_cpu.store_kv(cache.k, cache.v, k, v, slots, cache.k_scale, cache.v_scale)

    def attend(self, q: torch.Tensor, cache: LayerKV) -> torch.Tensor:
        """q [T, H, D] (the head dimension contiguous), caches [NB, bs, H, D] -> [T, H*D]."""
        p = self.paged
        scale = q.shape[-1] ** -0.5
        if p.max_query_len < LONG_RUN:  # decodes and short chunks: the kernel takes every row
            return _kernel(q, cache, p.query_start, p.context_lens, p.block_tables, scale)
        if self.parts is None:
            self.parts = split(p, cache.k.shape[1])
        s = self.parts
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # [T, H*D]
        if s.rows.numel():
            out[s.rows] = _kernel(q[s.rows], cache, s.query_start, s.context_lens, s.block_tables, scale)
        for run in s.long:
            out[run.start : run.end] = _dense(q[run.start : run.end], cache, run, scale)
        return out


def _kernel(
    q: torch.Tensor,
    cache: LayerKV,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The C++ kernel over every row of q: [T, H, D] -> [T, H*D]."""
    args = (q, cache.k, cache.v, query_start, context_lens, block_tables, scale, cache.k_scale, cache.v_scale)
    return torch.ops.gpt2_cpu.paged_attention(*args)


def _dense(q: torch.Tensor, cache: LayerKV, run: LongRun, scale: float) -> torch.Tensor:
    """One sequence's long run of query rows by torch's fused attention on its keys and values copied out whole (an
    int8 cache's dequantized in the queries' dtype, as the reference backend reads them): [Lq, H, D] -> [Lq, H*D]."""
    Lq, H, D = q.shape

    def copied(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        # [NB, bs, H, D] -> [H, NB, bs, D] (the head-major cache's own order) -> [H, nb, bs, D] -> [1, H, keys, D]
        x = values.movedim(2, 0).index_select(1, run.blocks)  # [H, nb, bs, D]
        if scales is not None:  # [NB, bs, H] -> [H, nb, bs], the same blocks' scales
            x = dequantize(x, scales.movedim(2, 0).index_select(1, run.blocks), q.dtype)
        return x.flatten(1, 2)[None, :, : run.keys]

    k, v = copied(cache.k, cache.k_scale), copied(cache.v, cache.v_scale)
    # [1, H, ...]: torch's fused CPU kernel takes four dimensions (with three it falls back to plain products)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=run.mask, scale=scale)  # [1,H,Lq,D]
    return out[0].transpose(0, 1).reshape(Lq, H * D)
