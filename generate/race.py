"""The draw: an exponential race over a batch's rows, in two rounds of about sqrt(V) entrants each.

argmax_i w_i / E_i, with E_i ~ Exp(1), is a draw of i with probability w_i / sum(w) (vLLM's sampler
draws so too), and it keeps its winner under any change of the weights smaller than the gap
between the two best entrants, where inverse-CDF sampling moves with every change of the sum before
the drawn token. Keyed noise (generate/noise.py) makes E_i a function of the row's seed, the position
drawn and i, so the winner depends on nothing else.

Noise for all V tokens (a hash and a logarithm each) costs more than the softmax that gives the
weights, so the tokens race in groups of S ~ sqrt(V) consecutive ids: first the groups, each with
its tokens' total weight (the fastest of a group's exponentials, E_i / w_i, is itself exponential at
the group's total rate: the race of groups draws a group by its mass), then the winning group's
tokens. The same draw, at the price of one sum over the weights and noise for ~2 sqrt(V) ids a row.
"""

import functools
import math
from typing import NamedTuple

import torch

from generate.noise import id_hashes, log_uniforms


class _Groups(NamedTuple):
    size: int  # S: tokens per group (the last group may have fewer)
    whole: int  # tokens in full groups
    group_hashes: torch.Tensor  # [G] int32: the groups' noise ids are the ones past the vocabulary
    tokens: torch.Tensor  # [G, S] long: each group's tokens; the last group's missing ones repeat its last
    token_hashes: torch.Tensor  # [G, S] int32


@functools.lru_cache(maxsize=8)
def _groups(vocab_size: int, device: torch.device) -> _Groups:
    size = math.isqrt(vocab_size)
    count = -(-vocab_size // size)
    hashes = id_hashes(vocab_size + count, device)  # [V + G]
    # A repeated token races once in effect: the same weight, the same noise, so the same score.
    tokens = torch.arange(count * size, device=device).clamp_(max=vocab_size - 1).view(count, size)  # [G, S]
    return _Groups(size, vocab_size // size * size, hashes[vocab_size:], tokens, hashes[tokens])


def exponential_race(weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:  # [N, V] >= 0, [N] int32 -> [N]
    """Each row's token, drawn with probability its weight / the row's sum."""
    n, vocab = weights.shape
    g = _groups(vocab, weights.device)
    mass = weights[:, : g.whole].view(n, -1, g.size).sum(dim=-1)  # [N, V // S]
    if g.whole < vocab:
        mass = torch.cat([mass, weights[:, g.whole :].sum(dim=-1, keepdim=True)], dim=1)  # [N, G]
    group = _race(mass, keys, g.group_hashes)  # [N]
    tokens = g.tokens[group]  # [N, S]
    winner = _race(weights.gather(1, tokens), keys, g.token_hashes[group])  # [N]
    return tokens.gather(1, winner.unsqueeze(1)).squeeze(1)


def _race(weights: torch.Tensor, keys: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:  # [N, K] -> [N]
    # w / E = -w / log u: the winner has the most negative w / log u (a weight of 0 never wins)
    return weights.div_(log_uniforms(keys, hashes)).argmin(dim=-1)
