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


def dense_attention(q, k_cache, v_cache, seqs, block_size, errors=None):
    """Causal attention of each sequence's rows over its keys in [NB, bs, H, D] caches (any H and D), in float64,
    written from scratch: [T, H*D]. With `errors` (the most each key and each value element may be off from what a
    reader of a quantized copy of these caches takes, [NB, bs, H, D] each), also how far attention over that copy
    can be from this, element by element: (output, bound), each [T, H*D].

    A key's element errs by at most e, so a score q . k / sqrt(D) by at most m_j = sum_d |q_d| e_jd / sqrt(D); over
    the keys a row sees, M = max_j m_j. Scores moved by at most M move each probability by a factor within
    [e^-2M, e^2M] (its own exponential by e^+-M, their sum by as much): |p'_j - p_j| <= (e^2M - 1) p_j. The output
    sum_j p'_j v'_j against sum_j p_j v_j differs by sum_j (p'_j - p_j) v_j + sum_j p'_j (v'_j - v_j), so by at most
    (e^2M - 1) sum_j p_j |v_j| + e^2M sum_j p_j e^v_j in each dimension: a bound, not an estimate (the errors' signs
    would have to conspire to reach it)."""
    _, _, heads, dim = k_cache.shape
    outputs, bounds, row = [], [], 0
    for seq in seqs:
        n, context = seq.num_scheduled_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
        blocks = torch.tensor(seq.block_table)
        keys, values = (c[blocks].reshape(-1, heads, dim)[:context].double() for c in (k_cache, v_cache))  # [K, H, D]
        queries = q[row : row + n].double()  # [n, H, D]
        later = torch.arange(context)[None, None, :] > torch.arange(context - n, context)[None, :, None]  # [1, n, K]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) / dim**0.5  # [H, n, K]
        probs = scores.masked_fill(later, float("-inf")).softmax(-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, values).reshape(n, heads * dim))
        if errors is not None:
            k_error, v_error = (e[blocks].reshape(-1, heads, dim)[:context].double() for e in errors)  # [K, H, D]
            shift = torch.einsum("qhd,khd->hqk", queries.abs(), k_error) / dim**0.5  # [H, n, K] each score's m_j
            grow = torch.expm1(2 * shift.masked_fill(later, 0).amax(-1, keepdim=True))  # [H, n, 1] e^2M - 1
            moved = grow * torch.einsum("hqk,khd->hqd", probs, values.abs())  # [H, n, D]
            moved += (1 + grow) * torch.einsum("hqk,khd->hqd", probs, v_error)
            bounds.append(moved.transpose(0, 1).reshape(n, heads * dim))
        row += n
    return torch.cat(outputs) if errors is None else (torch.cat(outputs), torch.cat(bounds))
