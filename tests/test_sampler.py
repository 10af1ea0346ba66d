"""Sampling: greedy, top-k and top-p stay inside their allowed sets; rows never leak into each other."""

import torch

from generate.sampling import sample
from generate.sequence import SamplingParams, Sequence

V = 50


def rows(n: int, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.full((n,), float(temperature)),
        torch.full((n,), top_k, dtype=torch.long),
        torch.full((n,), float(top_p)),
        torch.rand(n, generator=gen, dtype=torch.float64),
    )


def logits_for(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)).repeat(n, 1) * 3  # [n, V]


def test_greedy_rows_take_the_argmax_whatever_other_rows_do():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    temperature = torch.tensor([0.0, 1.5, 0.0, 0.7])
    top_k, top_p = torch.tensor([0, 3, 0, 0]), torch.tensor([1.0, 1.0, 0.5, 0.2])
    tokens = sample(logits, temperature, top_k, top_p, torch.rand(4, dtype=torch.float64))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_top_k_never_leaves_the_k_most_likely():
    logits = logits_for(4000)
    tokens = sample(logits, *rows(4000, top_k=5))
    allowed = set(logits[0].topk(5).indices.tolist())
    assert set(tokens.tolist()) == allowed  # all of them show up over 4000 draws, nothing else


def test_top_p_never_leaves_the_nucleus():
    logits = logits_for(4000)
    probs = torch.softmax(logits[0], dim=0)
    ordered = probs.argsort(descending=True).tolist()
    nucleus, mass = set(), 0.0
    for token in ordered:  # the smallest most-likely set whose mass reaches 0.6
        nucleus.add(token)
        mass += float(probs[token])
        if mass >= 0.6:
            break
    tokens = set(sample(logits, *rows(4000, top_p=0.6)).tolist())
    assert tokens <= nucleus and len(tokens) > 1


def test_temperature_one_follows_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).repeat(20000, 1)
    tokens = sample(logits, *rows(20000, seed=3))
    empirical = torch.bincount(tokens, minlength=5) / 20000
    assert (empirical - torch.softmax(logits[0], 0)).abs().sum() / 2 < 0.02  # total variation


def test_a_row_samples_the_same_alone_or_in_a_mixed_batch():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    temperature, top_k = torch.tensor([0.8, 0.0, 1.3]), torch.tensor([0, 0, 2])
    top_p, uniform = torch.tensor([0.9, 1.0, 1.0]), torch.tensor([0.37, 0.5, 0.91], dtype=torch.float64)
    batch = sample(logits, temperature, top_k, top_p, uniform)
    for i in range(3):
        row = slice(i, i + 1)
        alone = sample(logits[row], temperature[row], top_k[row], top_p[row], uniform[row])
        assert alone.item() == batch[i].item()


def test_a_draw_next_to_one_never_picks_a_masked_token():
    logits = logits_for(1)
    token = sample(logits, *rows(1, top_k=3)[:3], torch.tensor([1 - 1e-16], dtype=torch.float64))
    assert token.item() in logits[0].topk(3).indices.tolist()


def test_seeds_make_sequences_reproducible():
    draw = lambda seed: torch.rand(5, generator=Sequence([1], SamplingParams(seed=seed)).generator).tolist()
    assert draw(7) == draw(7) != draw(8)
