"""The step's new keys and values into the paged cache, every row and head, in one Triton launch.

PyTorch's indexed writes (model/attention.py `store`) take a launch for the keys and one for the
values, a few microseconds each, twice per layer of every step. One program per row reads its
keys and values (strided views of the [T, 3C] projection) and writes them to its slot,
block * bs + offset, through the caches' strides (paged_cache's head-major layout, or any).
The slots are read from a tensor: a CUDA graph replays it on new ones.

A quantized cache (KV_CACHE_DTYPE int8 or fp8) is written as model/attention.py `quantize` computes it, value for
value: each (row, head)'s scale max|x| / QMAX (IEEE division, as torch's), the row divided by it, rounded to
nearest even (int8: to an integer, clamped to +-127; fp8: to the 8-bit float's grid), and the scale beside it.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from model.attention import QMAX, LayerKV


@triton.jit
def _rint(x):
    """x rounded to the nearest integer, ties to even, for |x| < 2**22: past 1.5 * 2**23 a float32 holds no fraction,
    so adding it rounds as IEEE arithmetic does (to nearest even) and subtracting it back is exact. libdevice's rint,
    which Triton's interpreter lacks."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _to_grid(y, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """float32 y rounded to nearest even on the grid of a float with MANTISSA fraction bits whose normals start at
    2**MIN_EXP (below it, the subnormals' fixed spacing): a value that float holds exactly, so the cast to it after
    this rounds nothing. (The interpreter's float32-to-float8 cast rounds wrongly: it drops a rounding's carry
    into an odd exponent, 7.9 becoming 4 in e4m3.) Scaling by powers of two is exact."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127  # floor(log2|y|) (-127 for zero)
    exponent = tl.maximum(exponent, MIN_EXP) - MANTISSA  # log2 of the grid's spacing around y
    spacing = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    rounded = _rint(tl.abs(y) * inverse) * spacing  # >= 0
    # y's sign bit back, -0 for a negative y that rounds to 0 as torch's; by bits, since compiled Triton's -x is 0 - x
    # (+0 for x = 0: seen on an H200)
    sign = tl.where(bits < 0, -2147483648, 0)
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize(x, QMAX: tl.constexpr, FLOAT8: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """[BH, D] float32 rows -> (the values to store, in float32 and exact in the cache's dtype; [BH] scales)."""
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), QMAX)  # [BH]; div_rn: Triton's `/` is not IEEE's on CUDA
    scale = tl.where(scale > 0, scale, 1.0)  # a row of zeros
    y = tl.math.div_rn(x, scale[:, None])  # [BH, D] within +-QMAX, or a hair past
    if FLOAT8:
        return _to_grid(y, MANTISSA, MIN_EXP), scale
    return tl.minimum(tl.maximum(_rint(y), -QMAX), QMAX), scale


@triton.jit
def _store_kv(
    K, V, KCache, VCache, KScale, VScale, slots, heads,
    stride_t, stride_h, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    QUANTIZED: tl.constexpr, QMAX: tl.constexpr, FLOAT8: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
):  # fmt: skip
    """One row's new key and value, every head, into its cache slot: grid (rows,)."""
    row = tl.program_id(0)
    slot = tl.load(slots + row)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    mask = (h < heads)[:, None]
    src = row * stride_t + h[:, None] * stride_h + dims[None, :]  # [BH, D]
    dst = block * stride_cb + offset * stride_cs + h[:, None] * stride_ch + dims[None, :]
    if QUANTIZED:
        at = block * stride_sb + offset * stride_ss + h * stride_sh  # [BH] the rows' scales
        k, k_scale = _quantize(tl.load(K + src, mask=mask, other=0.0).to(tl.float32), QMAX, FLOAT8, MANTISSA, MIN_EXP)
        v, v_scale = _quantize(tl.load(V + src, mask=mask, other=0.0).to(tl.float32), QMAX, FLOAT8, MANTISSA, MIN_EXP)
        tl.store(KScale + at, k_scale, mask=h < heads)
        tl.store(VScale + at, v_scale, mask=h < heads)
        tl.store(KCache + dst, k.to(KCache.dtype.element_ty), mask=mask)
        tl.store(VCache + dst, v.to(VCache.dtype.element_ty), mask=mask)
    else:
        tl.store(KCache + dst, tl.load(K + src, mask=mask), mask=mask)
        tl.store(VCache + dst, tl.load(V + src, mask=mask), mask=mask)


@functools.cache
def quantized_constants(dtype: torch.dtype | None) -> dict:
    """The store kernel's constexprs for a cache in `dtype` (None: not quantized). Cached: a step calls it per layer."""
    if dtype is None:
        return dict(QUANTIZED=False, QMAX=0.0, FLOAT8=False, MANTISSA=0, MIN_EXP=0)
    if not dtype.is_floating_point:
        return dict(QUANTIZED=True, QMAX=QMAX[dtype], FLOAT8=False, MANTISSA=0, MIN_EXP=0)
    finfo = torch.finfo(dtype)  # e4m3: eps 2**-3, smallest normal 2**-6; e5m2: 2**-2, 2**-14
    mantissa, min_exp = round(-math.log2(finfo.eps)), round(math.log2(finfo.tiny))
    return dict(QUANTIZED=True, QMAX=QMAX[dtype], FLOAT8=True, MANTISSA=mantissa, MIN_EXP=min_exp)


def store_kv(
    cache: LayerKV,  # [NB, bs, H, D] each, any strides, D contiguous, v strided as k; scales [NB, bs, H], v's as k's
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
    scale_strides = (0, 0, 0)
    if cache.quantized:
        assert cache.k_scale.stride() == cache.v_scale.stride()
        scale_strides = cache.k_scale.stride()
    _store_kv[(T,)](
        k, v, k_cache, v_cache, cache.k_scale, cache.v_scale, slots, H,
        k.stride(0), k.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *scale_strides,
        BLOCK_SIZE=block_size, HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(H),
        **quantized_constants(k_cache.dtype if cache.quantized else None),
    )  # fmt: skip
