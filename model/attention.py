"""Attention over the paged KV cache: one interface, two backends.

A step's attention object is built by the engine from the scheduled sequences and called
by every layer: `attend(q, k_cache, v_cache)` returns each query row's attention output.
  reference  gathers each sequence's cache blocks into a dense buffer and runs
             scaled_dot_product_attention with a mask: plain PyTorch, any device, the oracle;
  triton     (model/triton_attention.py) reads keys and values through the block tables in
             place, with an online softmax: no gather, no padding to the longest context.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

BACKENDS = ("reference", "triton")


class StepAttention(Protocol):
    def attend(
        self,
        q: torch.Tensor,  # [T, H, D] the step's queries, flat over sequences
        k_cache: torch.Tensor,  # [NB, bs, H, D] this layer's keys, the step's new ones already written
        v_cache: torch.Tensor,  # [NB, bs, H, D]
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


class GatherSpace:
    """One reusable pair of buffers for the keys/values each attention group copies out of the paged cache.

    On CPU a fresh tensor of tens of megabytes per layer and step costs more in page faults (the
    allocator hands big blocks back to the OS) than the copy itself: reusing one buffer makes the
    gather ~6x faster. The layers run one after another, so they can share it.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [rows, bs, H, D], rows >= any group's blocks so far
        self.v: torch.Tensor | None = None

    def gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = blocks.numel()
        if self.k is None or self.k.shape[0] < n or self.k.dtype != k_cache.dtype or self.k.device != k_cache.device:
            self.k = k_cache.new_empty((n, *k_cache.shape[1:]))
            self.v = torch.empty_like(self.k)
        k = torch.index_select(k_cache, 0, blocks, out=self.k[:n])  # [n, bs, H, D]
        v = torch.index_select(v_cache, 0, blocks, out=self.v[:n])  # [n, bs, H, D]
        return k, v


@dataclass(slots=True)
class ReferenceAttention:
    groups: list[AttentionGroup]  # their out_rows cover the step's rows 0..T-1, each once
    space: GatherSpace

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        outputs = [self._attend_group(q, k_cache, v_cache, group) for group in self.groups]
        if len(outputs) == 1:
            return outputs[0]  # [T, C] one group holds every row, in order
        out = outputs[0].new_empty((q.shape[0], outputs[0].shape[1]))  # [T, C]
        for group, y in zip(self.groups, outputs):
            out[group.out_rows] = y
        return out

    def _attend_group(self, q, k_cache, v_cache, group: AttentionGroup) -> torch.Tensor:
        B, Lq = group.query_index.shape
        _, _, H, D = k_cache.shape
        # whole blocks: contiguous copies, far faster than per-key gathers
        k, v = self.space.gather(k_cache, v_cache, group.key_blocks.flatten())  # [B*nb, bs, H, D] each
        q = q[group.query_index].transpose(1, 2)  # [B, H, Lq, D]
        k = k.view(B, -1, H, D).transpose(1, 2)  # [B, H, Lk, D]
        v = v.view(B, -1, H, D).transpose(1, 2)  # [B, H, Lk, D]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask)  # [B, H, Lq, D]
        y = y.transpose(1, 2).reshape(B * Lq, -1)  # [B*Lq, C]
        return y if group.valid_rows is None else y[group.valid_rows]  # [rows, C]
