"""The benchmark's workloads: token-id prompts, requested lengths, seeds and arrival times, all deterministic.

seed-like      the original experiment: 100 requests, Poisson arrivals at 1 req/s, lengths normal(100, 50)
saturate       the same prompts, all sent at once
shared-prefix  one long system prompt in front of every question: the prefix cache's case
grouped-prefix groups of requests (GROUPS), each with its own long system prompt: routing replicas by prefix
sharegpt-like  prompt and response lengths drawn like chat traffic (log-normal, heavy-tailed)
long-prompts   32 short requests decoding while the rest, long prompts (700-1000 tokens), arrive: chunked prefill's case
"""

import math
import random
from typing import NamedTuple

import tiktoken

from client.data import PromptData, arrival_offsets
from config import MODES
from model.tokenizer import load_tokenizer

CONTEXT = 1024  # GPT-2's n_positions: a prompt and its completion must fit
SYSTEM_PROMPT_TOKENS = 500
GROUPS = 8  # grouped-prefix: system prompts, each shared by the requests of its group
# ShareGPT's mean lengths as reported in the vLLM paper (Kwon et al. 2023, Table 1): 161 in, 338 out.
SHAREGPT_MEAN_PROMPT = 161
SHAREGPT_SIGMA = 1.0  # spread of the log-normal: a long tail, median about 60% of the mean
DECODERS = 32  # long-prompts: short requests that decode while the long prompts arrive
LONG_PROMPT_TOKENS = (700, 1000)  # long-prompts: prompt lengths, uniform
LONG_PROMPT_OUTPUT = 16
LONG_PROMPTS_START_S = 2.0  # the first long prompt arrives once the decoders are running


class Request(NamedTuple):
    prompt_ids: list[int]
    num_tokens: int
    seed: int  # the sampling seed, the same in every run of the workload


class Workload(NamedTuple):
    name: str
    requests: list[Request]
    offsets: list[float]  # send times, seconds from the start of the run


class WorkloadSpec(NamedTuple):
    numsamples: int
    rate: float  # arrivals per second; inf sends all at once
    mean_tokens: float
    modes: tuple[str, ...]  # the server modes it compares
    prefix_cache: tuple[str, ...]  # the PREFIX_CACHE settings each mode runs with
    chunked_prefill: tuple[str, ...] = ("on",)  # the CHUNKED_PREFILL settings each mode runs with


WORKLOADS = {
    "seed-like": WorkloadSpec(100, 1.0, 100.0, MODES, ("on",)),
    "saturate": WorkloadSpec(256, math.inf, 100.0, MODES, ("on",)),
    "shared-prefix": WorkloadSpec(100, math.inf, 16.0, ("dynamic",), ("off", "on")),
    "grouped-prefix": WorkloadSpec(400, 8.0, 16.0, ("dynamic",), ("on",)),
    "sharegpt-like": WorkloadSpec(100, 1.0, 338.0, MODES, ("on",)),
    # DECODERS short requests, then numsamples - DECODERS long prompts, one every 1/rate seconds
    "long-prompts": WorkloadSpec(40, 0.2, 200.0, ("dynamic",), ("on",), ("off", "on")),
}


def build(name: str, numsamples: int, rate: float, mean_tokens: float, seed: int = 0, groups: int = GROUPS) -> Workload:
    """Workload `name` with `numsamples` requests (grouped-prefix: in `groups` groups, each request in a group drawn
    at random); the same arguments always give the same workload."""
    tokenizer = load_tokenizer()
    if name == "long-prompts":
        return _long_prompts(tokenizer, numsamples, rate, mean_tokens, seed)
    if name == "sharegpt-like":
        pairs = _sharegpt_like(tokenizer, numsamples, mean_tokens, seed)
    else:
        samples = PromptData(seed=seed, mean_tokens=mean_tokens, std_tokens=mean_tokens / 2).samples(numsamples)
        pairs = [(tokenizer.encode(s.prompt), s.num_tokens) for s in samples]
        if name == "shared-prefix":
            system = _long_text_ids(tokenizer, SYSTEM_PROMPT_TOKENS, seed)
            pairs = [(system + ids, n) for ids, n in pairs]
        elif name == "grouped-prefix":
            systems = group_system_prompts(tokenizer, groups, seed)
            rng = random.Random(f"grouped-prefix:{seed}")
            pairs = [(rng.choice(systems) + ids, n) for ids, n in pairs]
    assert all(len(ids) + n <= CONTEXT for ids, n in pairs)
    requests = [Request(ids, n, seed * 1_000_000 + i) for i, (ids, n) in enumerate(pairs)]
    return Workload(name, requests, arrival_offsets(numsamples, rate, seed))


def _long_prompts(tokenizer: tiktoken.Encoding, total: int, rate: float, mean_tokens: float, seed: int) -> Workload:
    """DECODERS short requests at once, then the other `total - DECODERS`, long prompts, at a steady `rate`
    (not Poisson: runs with and without chunked prefill must meet the long prompts at the same moments)."""
    if total <= DECODERS:
        raise ValueError(f"long-prompts needs more than {DECODERS} requests: {DECODERS} decoders, then long prompts")
    n = total - DECODERS
    rng = random.Random(f"long-prompts:{seed}")
    # decoders long enough to outlast the long prompts: not clipped at PromptData's usual 200 tokens
    data = PromptData(seed=seed, mean_tokens=mean_tokens, std_tokens=mean_tokens / 4, max_tokens=CONTEXT - 128)
    samples = data.samples(DECODERS)
    pairs = [(tokenizer.encode(s.prompt), s.num_tokens) for s in samples]
    text = _long_text_ids(tokenizer, 2 * CONTEXT, seed)
    for _ in range(n):
        length = rng.randint(*LONG_PROMPT_TOKENS)
        start = rng.randrange(len(text) - length)
        pairs.append((text[start : start + length], LONG_PROMPT_OUTPUT))
    assert all(len(ids) + tokens <= CONTEXT for ids, tokens in pairs)
    requests = [Request(ids, tokens, seed * 1_000_000 + i) for i, (ids, tokens) in enumerate(pairs)]
    interval = 0.0 if math.isinf(rate) else 1 / rate
    offsets = [0.0] * DECODERS + [LONG_PROMPTS_START_S + i * interval for i in range(n)]
    return Workload("long-prompts", requests, offsets)


def group_system_prompts(tokenizer: tiktoken.Encoding, groups: int, seed: int = 0) -> list[list[int]]:
    """grouped-prefix's system prompts of SYSTEM_PROMPT_TOKENS tokens, one per group, each its own from the first
    block on (and so from the first 16 tokens, which the balancer hashes)."""
    prompts = []
    for group in range(groups):
        opening = tokenizer.encode(f"You are assistant {group + 1}. Your instructions:\n")
        text = _long_text_ids(tokenizer, SYSTEM_PROMPT_TOKENS, seed * 1000 + group)
        prompts.append((opening + text)[:SYSTEM_PROMPT_TOKENS])
    return prompts


def _long_text_ids(tokenizer: tiktoken.Encoding, num_tokens: int, seed: int) -> list[int]:
    """`num_tokens` tokens of English-like text: benchmark prompts run together (each is over 4 tokens)."""
    samples = PromptData(seed=seed + 1).samples(num_tokens // 4)
    ids = tokenizer.encode(" ".join(s.prompt for s in samples))
    assert len(ids) >= num_tokens
    return ids[:num_tokens]


def _sharegpt_like(tokenizer: tiktoken.Encoding, n: int, mean_tokens: float, seed: int) -> list[tuple[list[int], int]]:
    """Log-normal prompt and response lengths with ShareGPT's means, clipped so both fit the context."""
    rng = random.Random(f"sharegpt:{seed}")
    text = _long_text_ids(tokenizer, 4 * CONTEXT, seed)
    pairs = []
    for _ in range(n):
        prompt_len = min(max(4, _lognormal(rng, SHAREGPT_MEAN_PROMPT)), CONTEXT // 2)
        num_tokens = min(max(1, _lognormal(rng, mean_tokens)), CONTEXT - prompt_len)
        start = rng.randrange(len(text) - prompt_len)
        pairs.append((text[start : start + prompt_len], num_tokens))
    return pairs


def _lognormal(rng: random.Random, mean: float) -> int:
    """A log-normal draw with the given mean (mu chosen so that exp(mu + sigma^2 / 2) = mean)."""
    return round(rng.lognormvariate(math.log(mean) - SHAREGPT_SIGMA**2 / 2, SHAREGPT_SIGMA))
