"""Sampling vectorised over a batch of rows: logit bias, penalties, greedy, temperature, top-k, top-p.

Every row carries its own settings and its own noise key (its request's seed and the position of
the token it draws), so one request's settings or seed never change another's tokens, and a token's
draw does not depend on the batch, the chunking or the cache path that computed its logits (see
generate/noise.py). Which stages run is decided from the rows' settings on the host, never by reading
GPU tensors, and the per-row settings reach the device in one copy: the only transfer back is the
sampled tokens.
"""

import math
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import torch

from generate.noise import row_key
from generate.race import exponential_race


class SamplingRow(NamedTuple):
    """One row's settings, as the host knows them."""

    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0  # in [0, 2**63): the request's (completion j of n: seed + j); with position, keys the noise
    position: int = 0  # of the token this row draws, in its sequence (prompt included)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit); -inf bans
    output_ids: tuple[int, ...] | list[int] = ()  # generated so far: presence and frequency count these
    prompt_ids: tuple[int, ...] | list[int] = ()  # repetition counts these too


@dataclass(slots=True)
class Penalties:
    presence: torch.Tensor  # [N] float32
    frequency: torch.Tensor  # [N]
    repetition: torch.Tensor  # [N]
    output_counts: torch.Tensor  # [N, V] float32: how often each row generated each token
    seen: torch.Tensor  # [N, V] bool: in the row's prompt or output (what the repetition penalty looks at)


@dataclass(slots=True)
class SamplingTensors:
    """Per-row settings on the device, and which stages any row needs (decided on the host)."""

    temperature: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] long
    top_p: torch.Tensor  # [N] float32
    noise_key: torch.Tensor  # [N] int32: (seed, position) mixed, see generate/noise.py
    all_greedy: bool
    any_greedy: bool
    unit_temperature: bool  # every row's temperature is 0 or 1: no division
    k_max: int  # largest top-k in use, capped at the vocabulary; 0: no row uses top-k
    nucleus_rows: torch.Tensor | None  # [n] rows with top_p < 1; None: none
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, tokens, values; None: no row has any
    penalties: Penalties | None  # None: no row has any

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> "SamplingTensors":
        """All rows' settings in one host-to-device copy."""
        penalised = [i for i, row in enumerate(rows) if _has_penalties(row)]
        nucleus = [i for i, row in enumerate(rows) if row.top_p < 1 and row.temperature > 0]
        bias = [(i, token, value) for i, row in enumerate(rows) for token, value in row.logit_bias]
        output = [(i, token) for i in penalised for token in rows[i].output_ids]
        prompt = [(i, token) for i in penalised if rows[i].repetition_penalty != 1 for token in rows[i].prompt_ids]
        pack = _HostPack()
        fields = {name: pack.add([getattr(row, name) for row in rows]) for name in _ROW_FIELDS}
        keys = pack.add([row_key(row.seed, row.position) for row in rows])
        parts = [pack.add(list(chain.from_iterable(x))) for x in (bias, output, prompt)] + [pack.add(nucleus)]
        packed = pack.copy_to(device)
        get = lambda part: packed[part]
        bias_t, output_t, prompt_t, nucleus_t = (get(p) for p in parts)
        penalties = None
        if penalised:
            counts = _count(output_t, len(rows), vocab_size)
            penalties = Penalties(
                *(get(fields[name]).float() for name in _PENALTY_FIELDS),
                output_counts=counts,
                seen=(counts > 0) | (_count(prompt_t, len(rows), vocab_size) > 0),
            )
        bias_t = bias_t.view(-1, 3)
        return cls(
            temperature=get(fields["temperature"]).float(),
            top_k=get(fields["top_k"]).long(),
            top_p=get(fields["top_p"]).float(),
            noise_key=get(keys).int(),
            all_greedy=all(row.temperature == 0 for row in rows),
            any_greedy=any(row.temperature == 0 for row in rows),
            unit_temperature=all(row.temperature in (0, 1) for row in rows),
            k_max=min(max((row.top_k for row in rows), default=0), vocab_size),
            nucleus_rows=nucleus_t.long() if nucleus else None,
            bias=(bias_t[:, 0].long(), bias_t[:, 1].long(), bias_t[:, 2].float()) if bias else None,
            penalties=penalties,
        )


_PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty")
_ROW_FIELDS = ("temperature", "top_k", "top_p", *_PENALTY_FIELDS)


def _has_penalties(row: SamplingRow) -> bool:
    return bool(row.presence_penalty or row.frequency_penalty or row.repetition_penalty != 1)


class _HostPack:
    """Lists of numbers gathered on the host and sent to the device as one float64 tensor (exact for
    token ids and settings alike), then read as views: one transfer per step, not one per field."""

    def __init__(self) -> None:
        self._parts: list[list[float]] = []
        self._size = 0

    def add(self, values: list[float]) -> slice:
        self._parts.append(values)
        self._size += len(values)
        return slice(self._size - len(values), self._size)

    def copy_to(self, device: torch.device) -> torch.Tensor:
        flat = torch.tensor(list(chain.from_iterable(self._parts)), dtype=torch.float64)
        if device.type == "cuda":  # from pageable memory the copy would wait for the forward pass
            flat = flat.pin_memory()
        return flat.to(device, non_blocking=True)


def _count(pairs: torch.Tensor, n: int, vocab_size: int) -> torch.Tensor:
    """[n, V] counts of the flattened (row, token) pairs."""
    pairs = pairs.view(-1, 2).long()
    counts = torch.zeros(n, vocab_size, dtype=torch.float32, device=pairs.device)
    ones = torch.ones(len(pairs), dtype=torch.float32, device=pairs.device)
    return counts.index_put_((pairs[:, 0], pairs[:, 1]), ones, accumulate=True)


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:  # logits [N, V] float32 -> [N] long
    """A draw from p = softmax(logits / T) over the tokens top-k and top-p keep, by an exponential race
    keyed by (seed, position, token): it changes only where two candidates are within the logits'
    rounding of each other. Greedy rows take the argmax."""
    logits = adjust_logits(logits, t)
    # max's indices are argmax's (the first largest), in torch's faster reduction on a CPU: 2.1 against 0.8 ms over
    # 64 x 50,257 (Xeon Sapphire Rapids, 2 threads)
    greedy = logits.max(dim=-1).indices if t.any_greedy else None  # [N]
    if t.all_greedy:
        return greedy
    if t.k_max:
        logits = _mask_top_k(logits, t.top_k, t.k_max)
    if t.nucleus_rows is not None:  # only these rows pay for a full sort
        rows = t.nucleus_rows
        logits = logits.index_copy(0, rows, _mask_top_p(logits[rows], t.temperature[rows], t.top_p[rows]))
    drawn = exponential_race(_weights(logits, t), t.noise_key)  # [N]
    return drawn if greedy is None else torch.where(t.temperature == 0, greedy, drawn)


def _weights(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:  # [N, V] -> [N, V]
    """The distribution at each row's temperature, up to a factor per row (all the race needs), in one new
    tensor: on a CPU each fresh [N, V] tensor costs its page faults, and a division then a softmax made
    the stage ~3x slower at batch 64. At temperature 1 torch's fused softmax is the faster pass."""
    if t.unit_temperature:  # greedy rows' draws are thrown away, whatever their temperature does
        return torch.softmax(logits, dim=-1)
    weights = logits - logits.amax(dim=-1, keepdim=True)  # [N, V], <= 0
    return weights.div_(t.temperature.clamp(min=1e-5).unsqueeze(1)).exp_()


def adjust_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Logit bias, then penalties: a new tensor when either applies, else the same one."""
    if t.bias is not None:
        rows, tokens, values = t.bias
        logits = logits.index_put((rows, tokens), values, accumulate=True)
    if t.penalties is not None:
        logits = apply_penalties(logits, t.penalties)
    return logits


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Repetition (over prompt and output, as vLLM), then OpenAI's frequency and presence (over output)."""
    repetition = p.repetition.unsqueeze(1)  # [N, 1]
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(p.seen, penalised, logits)
    present = (p.output_counts > 0).float()
    return logits - p.frequency.unsqueeze(1) * p.output_counts - p.presence.unsqueeze(1) * present


def _mask_top_k(logits: torch.Tensor, top_k: torch.Tensor, k_max: int) -> torch.Tensor:
    top_values = logits.topk(k_max, dim=-1).values  # [N, k_max], descending
    kth = top_values.gather(1, (top_k.clamp(1, k_max) - 1).unsqueeze(1))  # [N, 1]
    kth = torch.where(top_k.unsqueeze(1) > 0, kth, torch.full_like(kth, -math.inf))
    return logits.masked_fill(logits < kth, -math.inf)


def _mask_top_p(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens (at the row's temperature) whose mass reaches top_p;
    the others go to -inf. [n, V] -> [n, V]"""
    probs = torch.softmax(logits / temperature.clamp(min=1e-5).unsqueeze(1), dim=-1)  # [n, V]
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [n, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [n, V]
    dropped = torch.empty_like(mass_before, dtype=torch.bool).scatter_(1, order, mass_before >= top_p.unsqueeze(1))
    return logits.masked_fill(dropped, -math.inf)  # the most likely token always stays


def top_logprobs(
    logits: torch.Tensor,  # [N, V]
    tokens: torch.Tensor,  # [N] the chosen tokens
    n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [N], [N, n], [N, n]
    """Log-probability of each chosen token, and the n most likely tokens' ids and log-probabilities."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [N, V]
    top = logprobs.topk(n, dim=-1)  # [N, n]
    return logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1), top.indices, top.values
