"""Greedy, temperature, top-k and top-p sampling, vectorised over a batch of rows.

Every row carries its own settings and its own uniform draw (from its sequence's
generator), so one request's settings or seed never change another's tokens.
"""

import torch


def sample(
    logits: torch.Tensor,  # [N, V] float32
    temperature: torch.Tensor,  # [N], 0 = greedy
    top_k: torch.Tensor,  # [N] long, 0 = off
    top_p: torch.Tensor,  # [N], 1 = off
    uniform: torch.Tensor,  # [N] in [0, 1), one draw per row
) -> torch.Tensor:  # [N] long
    greedy = logits.argmax(dim=-1)  # [N]
    if bool((temperature == 0).all()):
        return greedy
    logits = logits / temperature.clamp(min=1e-5).unsqueeze(1)  # [N, V]
    if bool((top_k > 0).any()):
        logits = _mask_top_k(logits, top_k)
    probs = torch.softmax(logits, dim=-1)  # [N, V]
    nucleus = (top_p < 1).nonzero().squeeze(1)  # only these rows pay for a full sort
    if len(nucleus):
        probs[nucleus] = _mask_top_p(probs[nucleus], top_p[nucleus])
    return torch.where(temperature == 0, greedy, _draw(probs, uniform))


def _mask_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    k_max = min(int(top_k.max()), logits.shape[1])
    top_values = logits.topk(k_max, dim=-1).values  # [N, k_max], descending
    kth = top_values.gather(1, (top_k.clamp(1, k_max) - 1).unsqueeze(1))  # [N, 1]
    kth = torch.where(top_k.unsqueeze(1) > 0, kth, torch.full_like(kth, -torch.inf))
    return logits.masked_fill(logits < kth, -torch.inf)


def _mask_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [n, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [n, V]
    sorted_probs[mass_before >= top_p.unsqueeze(1)] = 0  # the most likely token always stays
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the first token whose cumulative mass exceeds u * total."""
    cdf = probs.double().cumsum(dim=-1)  # [N, V]; float64 so the tail mass is not lost
    total = cdf[:, -1]  # [N]
    target = torch.minimum(uniform.to(cdf) * total, torch.nextafter(total, torch.zeros_like(total)))
    # cdf[i] > target with cdf[i-1] <= target implies probs[i] > 0: masked tokens never win
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)  # [N]


def top_logprobs(
    logits: torch.Tensor,  # [N, V]
    tokens: torch.Tensor,  # [N] the chosen tokens
    n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [N], [N, n], [N, n]
    """Log-probability of each chosen token, and the n most likely tokens' ids and log-probabilities."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [N, V]
    top = logprobs.topk(n, dim=-1)  # [N, n]
    return logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1), top.indices, top.values
