"""Paged attention in Triton: queries read their keys and values through the block tables, in place.

One program per (sequence, head, tile of up to BLOCK_M query rows). It walks the sequence's
cache BLOCK_N keys at a time, finding each key's block in the block table, with an online
softmax (running max and sum), so no key is copied, nothing is padded to the longest
context, and a chunk of new tokens attends causally over the cache and itself. Context
lengths and query offsets are read from tensors, so a CUDA graph can replay it on new values.
Under TRITON_INTERPRET=1 it runs on CPU tensors (slowly), which is how CI checks it.

A decode step with few (sequence, head) pairs would run few programs, each walking its whole
context alone while most of the GPU idles: there the keys are split (flash-decoding). Each
program takes one partition of a sequence's keys and writes its partial max, sum and
accumulator; a second kernel combines them. The partition count depends only on the batch's
shapes, the partition length is computed in the kernel from the context: a graph replays it.
The step's new keys and values go into the cache in one launch (model/triton_store.py).

A quantized cache (KV_CACHE_DTYPE int8 or fp8: 8-bit values and a float32 scale per token and head, see
model/attention.py) is read in place too: each loop iteration loads its keys' and values' scales beside them and
attends over stored * scale, in float32, then (tl.dot's path) in q's dtype, as the reference backend dequantizes.
The QUANTIZED constexpr picks that variant; an unquantized cache runs the code before it, reading no scales.

Triton compiles one variant per constexpr and per specialisation of the other arguments (a pointer
divisible by 16 or not, an integer equal to 1 or divisible by 16). So the step's inputs are uploaded
16-byte aligned (generate/step_input.py), `stride_bt` (the block tables' width, which changes with
the longest context in a step) and the partition count are not specialised on, and the engine warms
the variants before the server reports ready: a chunk (the tiled kernel, which large decode steps
share while decode_block_m == chunk_block_m) and a one-row decode whose block table is wider than
block_n keys (the split kernel and its combine): nothing compiles while serving.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from model.attention import LayerKV, PagedInputs
from model.triton_store import store_kv


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
    # 71 against 262 us). Masking 15 of 16 rows costs less than leaving the tensor cores idle. The split
    # decode kernel takes the same tile: its loop is this one, over fewer keys.
    block_n: int = 32  # keys per loop iteration
    num_warps: int = 2
    decode_block_m: int = 16  # query rows per program when every sequence decodes one; 16 takes tl.dot's path
    chunk_block_m: int = 16  # ... when some sequence computes a chunk: tensor cores need 16 rows
    table_dtype: torch.dtype = torch.int64  # block-table entries as the kernel reads them
    # A decode step of fewer (sequence, head) pairs than this splits each one's keys until about this many
    # programs run. At batch 1 of gpt2-medium on an H100 the unsplit kernel ran 16 programs, each walking ~214
    # keys alone: 11 us a layer, bound by its loop's latency, most SMs idle. None: two waves of the device's
    # SMs (264 on an H100 or H200; under the interpreter, of INTERPRETER_SMS).
    split_target_programs: int | None = None
    # At most this many partitions (each at least block_n keys): 16 x 32 keys cover a 512-key context in one
    # iteration per program; more would add scratch traffic and combine work for the longest contexts only.
    split_max_partitions: int = 16


DEFAULT = KernelConfig()
# Under the interpreter a CPU stands in for a GPU this small: a tiny model's tests run split decodes at batch 1
# and unsplit ones above, without paying the interpreter's cost per program for hundreds of programs a layer.
INTERPRETER_SMS = 4


@functools.cache
def _target_programs(device: torch.device) -> int:
    sms = INTERPRETER_SMS if device.type != "cuda" else torch.cuda.get_device_properties(device).multi_processor_count
    return 2 * sms


def partitions(num_seqs: int, heads: int, max_keys: int, device: torch.device, config: KernelConfig = DEFAULT) -> int:
    """Key partitions per (sequence, head) of a decode step; 1: the unsplit kernel. A function of shapes only,
    never of the context lengths: a CUDA graph replays the grid it captured. `max_keys` (the block tables'
    width in keys: in a graph's static tables the model's longest context) caps it at one loop iteration of
    keys per partition, so short steps run no empty partitions."""
    target = _target_programs(device) if config.split_target_programs is None else config.split_target_programs
    pairs = num_seqs * heads
    if pairs >= target:
        return 1
    wanted = min(config.split_max_partitions, triton.cdiv(target, pairs))
    return min(wanted, triton.cdiv(max_keys, config.block_n))


@triton.jit
def _dequantize(x, scale, q, BLOCK_M: tl.constexpr):
    """Stored [BN, D] times its rows' scales [BN] in float32; for tl.dot's path, then in q's dtype (as
    model/attention.py `dequantize` gives the reference backend), else float32 for the products on CUDA cores."""
    x = x.to(tl.float32) * scale[:, None]
    if BLOCK_M >= 16:  # one return: compiled Triton refuses a function whose returns differ in dtype
        x = x.to(q.dtype)
    return x


@triton.jit
def _attend_keys(
    q, last_key, key_start, key_end, K, V, KS, VS, table, head_offset, scale_offset,
    stride_kb, stride_ks, stride_sb, stride_ss, scale,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
):  # fmt: skip
    """Online softmax of q's rows [BM, D] over keys key_start..key_end-1, row r seeing keys up to last_key[r]:
    the running max [BM], sum [BM] and unnormalised output [BM, D]. No keys: -inf, 0 and 0. QUANTIZED: K and V
    hold 8-bit values, each key's row scaled by its float32 scale in KS / VS (at block * stride_sb + offset *
    stride_ss + scale_offset); else K and V are in q's dtype and KS, VS are not read."""
    dims = tl.arange(0, HEAD_DIM)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for first in range(key_start, key_end, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        present = keys < key_end
        block = tl.load(table + keys // BLOCK_SIZE, mask=present, other=0)
        offset = block[:, None] * stride_kb + (keys % BLOCK_SIZE)[:, None] * stride_ks + head_offset
        k = tl.load(K + offset + dims[None, :], mask=present[:, None], other=0.0)  # [BN, D]
        v = tl.load(V + offset + dims[None, :], mask=present[:, None], other=0.0)  # [BN, D]
        if QUANTIZED:
            at = block * stride_sb + (keys % BLOCK_SIZE) * stride_ss + scale_offset  # [BN] each key's row scale
            k = _dequantize(k, tl.load(KS + at, mask=present, other=0.0), q, BLOCK_M)
            v = _dequantize(v, tl.load(VS + at, mask=present, other=0.0), q, BLOCK_M)
        s = _scores(q, k, BLOCK_M, PRECISION) * scale  # [BM, BN]
        # causal, which also hides absent keys: every row sees the range's first key, so no row is all -inf
        s = tl.where(keys[None, :] <= last_key[:, None], s, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(s, axis=1))
        p = tl.exp(s - new_max[:, None])  # [BM, BN]
        rescale = tl.exp(running_max - new_max)
        running_sum = running_sum * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + _weighted(p, v, BLOCK_M, PRECISION)
        running_max = new_max
    return running_max, running_sum, acc


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention(
    Q, K, V, KS, VS, Out, query_start, context_lens, block_tables,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_sb, stride_ss, stride_sh, scale,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
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
        key_end = tl.minimum(context, context - q_len + (tile + 1) * BLOCK_M)  # what the tile's last row sees
        _, running_sum, acc = _attend_keys(
            q, query_pos, 0, key_end, K, V, KS, VS, block_tables + seq * stride_bt, head * stride_kh,
            head * stride_sh, stride_kb, stride_ks, stride_sb, stride_ss, scale,
            BLOCK_SIZE, HEAD_DIM, BLOCK_M, BLOCK_N, PRECISION, QUANTIZED,
        )  # fmt: skip
        out = acc / running_sum[:, None]
        out_ptr = Out + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
        tl.store(out_ptr, out.to(Out.dtype.element_ty), mask=real[:, None])


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_split(
    Q, K, V, KS, VS, PartMax, PartSum, PartAcc, query_start, context_lens, block_tables,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_sb, stride_ss, stride_sh, scale,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
):  # fmt: skip
    """A decode row's attention over one partition of its keys: grid (sequence, head, partition). Writes the
    partition's max, sum and unnormalised output to [S, H, P] and [S, H, P, D] scratch."""
    seq, head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_parts = tl.num_programs(2)
    context = tl.load(context_lens + seq)
    # whole loop iterations per partition, so only the last one's last tile reads past its keys
    chunk = tl.cdiv(tl.cdiv(context, num_parts), BLOCK_N) * BLOCK_N
    key_start = part * chunk
    key_end = tl.minimum(context, key_start + chunk)  # at or below key_start: an empty partition
    rows = tl.arange(0, BLOCK_M)  # row 0 is the sequence's one query; the others pad the tile for tl.dot
    dims = tl.arange(0, HEAD_DIM)
    real = rows < 1
    q_ptr = Q + (tl.load(query_start + seq) + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptr, mask=real[:, None], other=0.0)  # [BM, D]
    last_key = tl.full([BLOCK_M], 0, tl.int64) + key_end - 1  # [BM] the query sees every key of its range
    running_max, running_sum, acc = _attend_keys(
        q, last_key, key_start, key_end, K, V, KS, VS, block_tables + seq * stride_bt, head * stride_kh,
        head * stride_sh, stride_kb, stride_ks, stride_sb, stride_ss, scale,
        BLOCK_SIZE, HEAD_DIM, BLOCK_M, BLOCK_N, PRECISION, QUANTIZED,
    )  # fmt: skip
    at = (seq * tl.num_programs(1) + head) * num_parts + part + rows  # [BM] only row 0 is stored
    tl.store(PartMax + at, running_max, mask=real)
    tl.store(PartSum + at, running_sum, mask=real)
    tl.store(PartAcc + at[:, None] * HEAD_DIM + dims[None, :], acc, mask=real[:, None])


@triton.jit(do_not_specialize=["num_parts"])
def _combine_partitions(
    PartMax, PartSum, PartAcc, Out, query_start, stride_ot, stride_oh, num_parts,
    HEAD_DIM: tl.constexpr, MAX_PARTS: tl.constexpr,
):  # fmt: skip
    """A decode row's output from its partitions' partials: grid (sequence, head). Partitions without keys
    hold max -inf, sum 0: their weight exp(-inf - max) is 0, and the first partition always has keys."""
    seq, head = tl.program_id(0), tl.program_id(1)
    parts = tl.arange(0, MAX_PARTS)  # a fixed width for every partition count: one compiled variant
    dims = tl.arange(0, HEAD_DIM)
    present = parts < num_parts
    at = (seq * tl.num_programs(1) + head) * num_parts + parts  # [MP]
    part_max = tl.load(PartMax + at, mask=present, other=float("-inf"))  # [MP]
    part_sum = tl.load(PartSum + at, mask=present, other=0.0)  # [MP]
    part_acc = tl.load(PartAcc + at[:, None] * HEAD_DIM + dims[None, :], mask=present[:, None], other=0.0)
    weight = tl.exp(part_max - tl.max(part_max, axis=0))  # [MP]
    out = tl.sum(part_acc * weight[:, None], axis=0) / tl.sum(part_sum * weight, axis=0)  # [D]
    out_ptr = Out + tl.load(query_start + seq) * stride_ot + head * stride_oh + dims
    tl.store(out_ptr, out.to(Out.dtype.element_ty))


class TritonAttention:
    """The step's attention through the Triton kernels; `paged` may be a CUDA graph's static buffers."""

    store = staticmethod(store_kv)
    fused_norms = True  # the model runs each residual add with its LayerNorm in one kernel (model/triton_norm.py)

    def __init__(self, paged: PagedInputs, config: KernelConfig = DEFAULT):
        self.paged, self.config = paged, config
        tables = paged.block_tables
        self.block_tables = tables if tables.dtype == config.table_dtype else tables.to(config.table_dtype)

    def attend(self, q: torch.Tensor, cache: LayerKV) -> torch.Tensor:
        T, H, D = q.shape
        k_cache, v_cache = cache.k, cache.v
        assert k_cache.stride(3) == 1 and q.stride(2) == 1 and k_cache.stride() == v_cache.stride()
        assert not cache.quantized or cache.k_scale.stride() == cache.v_scale.stride()
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)  # [T, H, D]
        num_seqs, max_keys = self.paged.context_lens.shape[0], self.block_tables.shape[1] * k_cache.shape[1]
        parts = partitions(num_seqs, H, max_keys, q.device, self.config) if self.paged.max_query_len == 1 else 1
        if parts > 1:
            self._attend_split(q, cache, out, parts)
        else:
            self._attend_tiles(q, cache, out)
        return out.view(T, H * D)  # [T, C]

    def _launch_args(self, q: torch.Tensor, cache: LayerKV) -> tuple[dict, dict]:
        """What both attention kernels take: strides after the outputs', and the constexprs. Not quantized, the
        scales' pointers are None and their strides 0: a variant that reads none."""
        k_cache = cache.k
        _, block_size, _, _ = k_cache.shape
        config, tables = self.config, self.block_tables
        scale_strides = cache.k_scale.stride() if cache.quantized else (0, 0, 0)  # [NB, bs, H]
        strides = dict(
            stride_kb=k_cache.stride(0), stride_ks=k_cache.stride(1), stride_kh=k_cache.stride(2),
            stride_bt=tables.stride(0), **dict(zip(("stride_sb", "stride_ss", "stride_sh"), scale_strides)),
            scale=q.shape[2] ** -0.5,
        )  # fmt: skip
        constants = dict(
            BLOCK_SIZE=block_size, HEAD_DIM=q.shape[2], BLOCK_N=config.block_n,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QUANTIZED=cache.quantized,
            num_warps=config.num_warps,
        )  # fmt: skip
        return strides, constants

    def _attend_tiles(self, q: torch.Tensor, cache: LayerKV, out: torch.Tensor) -> None:
        paged, config = self.paged, self.config
        block_m = config.decode_block_m if paged.max_query_len == 1 else config.chunk_block_m
        grid = (paged.context_lens.shape[0], q.shape[1], triton.cdiv(paged.max_query_len, block_m))
        strides, constants = self._launch_args(q, cache)
        _paged_attention[grid](
            q, cache.k, cache.v, cache.k_scale, cache.v_scale, out, paged.query_start, paged.context_lens,
            self.block_tables, stride_qt=q.stride(0), stride_qh=q.stride(1), stride_ot=out.stride(0),
            stride_oh=out.stride(1), **strides, BLOCK_M=block_m, **constants,
        )  # fmt: skip

    def _attend_split(self, q: torch.Tensor, cache: LayerKV, out: torch.Tensor, parts: int) -> None:
        """Flash-decoding: each (sequence, head)'s keys in `parts` partitions, then their partials combined."""
        paged, config = self.paged, self.config
        S, H, D = paged.context_lens.shape[0], q.shape[1], q.shape[2]
        part_max = torch.empty((S, H, parts), dtype=torch.float32, device=q.device)  # [S, H, P]
        part_sum = torch.empty_like(part_max)  # [S, H, P]
        part_acc = torch.empty((S, H, parts, D), dtype=torch.float32, device=q.device)  # [S, H, P, D]
        strides, constants = self._launch_args(q, cache)
        _paged_attention_split[(S, H, parts)](
            q, cache.k, cache.v, cache.k_scale, cache.v_scale, part_max, part_sum, part_acc, paged.query_start,
            paged.context_lens, self.block_tables, stride_qt=q.stride(0), stride_qh=q.stride(1),
            **strides, BLOCK_M=config.decode_block_m, **constants,
        )  # fmt: skip
        _combine_partitions[(S, H)](
            part_max, part_sum, part_acc, out, paged.query_start, out.stride(0), out.stride(1), parts,
            HEAD_DIM=D, MAX_PARTS=triton.next_power_of_2(config.split_max_partitions),
        )  # fmt: skip
