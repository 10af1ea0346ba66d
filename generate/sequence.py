"""One sequence's generation state, as the scheduler, block manager and engine see it."""

import enum
import itertools
import secrets
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from model.tokenizer import EOT_ID


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None  # None: a fresh random seed
    stop_at_eos: bool = False
    logprobs: int | None = None  # None: none; n: each token's log-probability and the n most likely

    def __post_init__(self) -> None:
        assert self.max_tokens >= 1 and self.temperature >= 0 and self.top_k >= 0 and 0 < self.top_p <= 1
        assert self.logprobs is None or self.logprobs >= 0


class TokenLogprobs(NamedTuple):
    """Log-probabilities under the model's own distribution (before temperature, top-k, top-p)."""

    logprob: float  # of the token that was chosen
    top: tuple[tuple[int, float], ...]  # the most likely tokens, most likely first


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    token_ids: list[int]  # prompt, then generated tokens
    params: SamplingParams = field(default_factory=SamplingParams)
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "length" or "stop"
    generator: torch.Generator = field(init=False)
    # KV state, owned by the block manager and the engine
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose keys/values are in the cache
    num_scheduled_tokens: int = 0  # tokens the current step computes: a prompt chunk, or the last token
    num_cached_tokens: int = 0  # of those, taken from the prefix cache at admission
    num_committed_blocks: int = 0
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per generated token, if asked for

    def __post_init__(self) -> None:
        assert self.token_ids, "a sequence needs at least one prompt token"
        self.num_prompt_tokens = len(self.token_ids)
        seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_new_tokens(self) -> int:
        """Tokens not yet in the cache: the rest of the prompt, or the last generated one."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def samples_this_step(self) -> bool:
        """Whether the scheduled tokens reach the end, so the step gives this sequence a next token."""
        return self.num_scheduled_tokens > 0 and self.num_computed_tokens + self.num_scheduled_tokens == len(
            self.token_ids
        )

    def append(self, token: int) -> None:
        """Record a sampled token; mark the sequence finished if it ends here."""
        self.token_ids.append(token)
        if self.params.stop_at_eos and token == EOT_ID:
            self.finish_reason = "stop"
        elif len(self.token_ids) - self.num_prompt_tokens >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason:
            self.status = Status.FINISHED
