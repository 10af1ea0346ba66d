"""The step's new keys and values into the paged cache, every row and head, in one Triton launch.

PyTorch's indexed writes (model/attention.py `store`) take a launch for the keys and one for the
values, a few microseconds each, twice per layer of every step. One program per row reads its
keys and values (strided views of the [T, 3C] projection) and writes them to its slot,
block * bs + offset, through the caches' strides (paged_cache's head-major layout, or any).
The slots are read from a tensor: a CUDA graph replays it on new ones.
"""

import torch
import triton
import triton.language as tl

from model.attention import LayerKV


@triton.jit
def _store_kv(
    K, V, KCache, VCache, slots, heads,
    stride_t, stride_h, stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """One row's new key and value, every head, into its cache slot: grid (rows,)."""
    row = tl.program_id(0)
    slot = tl.load(slots + row)
    h = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    mask = (h < heads)[:, None]
    src = row * stride_t + h[:, None] * stride_h + dims[None, :]  # [BH, D]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h[:, None] * stride_ch + dims[None, :]
    tl.store(KCache + dst, tl.load(K + src, mask=mask), mask=mask)
    tl.store(VCache + dst, tl.load(V + src, mask=mask), mask=mask)


def store_kv(
    cache: LayerKV,  # [NB, bs, H, D] each, any strides, D contiguous, v strided as k
    k: torch.Tensor,  # [T, H, D] views of the [T, 3C] projection
    v: torch.Tensor,  # [T, H, D]
    slots: torch.Tensor,  # [T] block * bs + offset
) -> None:
    """StepAttention.store in one launch (indexed writes take two, of a few microseconds each, per layer)."""
    T, H, D = k.shape
    k_cache, v_cache = cache.k, cache.v
    _, block_size, _, _ = k_cache.shape
    assert k.stride() == v.stride() and k.stride(2) == 1, "k and v: views of one [T, 3C] projection"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    _store_kv[(T,)](
        k, v, k_cache, v_cache, slots, H,
        k.stride(0), k.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(H),
    )  # fmt: skip
