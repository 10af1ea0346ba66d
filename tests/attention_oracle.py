"""Attention written from scratch over a paged cache, and the step shapes both backends are checked at."""

import torch

from generate.sequence import Sequence
from model.attention import paged_cache

H, D = 4, 64  # GPT-2's head dimension

# (tokens scheduled, context) of each sequence in a step
SHAPES = {
    "decodes": [(1, 1), (1, 15), (1, 16), (1, 17), (1, 64), (1, 300)],
    "full context": [(1, 1024), (1, 2)],
    "chunks": [(7, 7), (16, 32), (33, 40), (5, 16), (1, 9), (1, 48)],
    "whole prompt": [(1024, 1024)],
}


LAYOUTS = ["head-major", "token-major"]  # the model's cache (model.attention.paged_cache), and a plain tensor


def random_cache(layout: str, num_blocks: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """[NB, bs, H, D] of standard normal values, stored as `layout` says."""
    values = torch.randn((num_blocks, block_size, H, D), generator=gen)
    if layout == "token-major":
        return values
    return paged_cache(blocks=num_blocks, block_size=block_size, heads=H, head_dim=D).copy_(values)


def scheduled(block_size: int, num_blocks: int, shapes: list[tuple[int, int]], seed: int) -> list[Sequence]:
    """Sequences with `context` tokens of which the last `chunk` are scheduled, over shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for chunk, context in shapes:
        seq = Sequence([1] * context)
        needed = -(-context // block_size)
        seq.block_table, free = free[:needed], free[needed:]
        seq.num_computed_tokens, seq.num_scheduled_tokens = context - chunk, chunk
        seqs.append(seq)
    return sorted(seqs, key=lambda s: s.num_scheduled_tokens == 1)  # chunks first, as the engine orders them


def dense_attention(q, k_cache, v_cache, seqs, block_size) -> torch.Tensor:
    """Causal attention of each sequence's rows over its keys, in float64, written from scratch."""
    outputs, row = [], 0
    for seq in seqs:
        n, context = seq.num_scheduled_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
        blocks = torch.tensor(seq.block_table)
        k = k_cache[blocks].reshape(-1, H, D)[:context].double()  # [context, H, D]
        v = v_cache[blocks].reshape(-1, H, D)[:context].double()
        scores = torch.einsum("qhd,khd->hqk", q[row : row + n].double(), k) / D**0.5
        query_pos = torch.arange(context - n, context)
        scores = scores.masked_fill(torch.arange(context)[None, None, :] > query_pos[None, :, None], float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, H * D))
        row += n
    return torch.cat(outputs)
