"""One sequence's generation state, as the scheduler, block manager and engine see it."""

import enum
import itertools
import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from model.tokenizer import EOT_ID

if TYPE_CHECKING:
    import llguidance

    from generate.constraints import CompiledConstraint
    from model.lora import LoraAdapter

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16  # 0: compute the prompt only (for its log-probabilities), generate nothing
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None  # in [0, 2**63); None: a fresh random one, drawn when the sequence is made
    stop_at_eos: bool = False
    logprobs: int | None = None  # None: none; n: each token's log-probability and the n most likely
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    min_tokens: int = 0  # neither end-of-text nor a stop string ends the sequence before this many tokens
    presence_penalty: float = 0.0  # OpenAI's, over generated tokens: logit -= presence * [count > 0]
    frequency_penalty: float = 0.0  # ... and -= frequency * count
    repetition_penalty: float = 1.0  # CTRL's, over prompt and generated tokens: logit / p if > 0, else logit * p
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit before sampling)
    constraint: "CompiledConstraint | None" = None  # structured output: compiled before admission (constraints.py)

    def __post_init__(self) -> None:
        assert self.max_tokens >= 0 and self.temperature >= 0 and self.top_k >= 0 and 0 < self.top_p <= 1
        assert self.logprobs is None or self.logprobs >= 0
        assert self.prompt_logprobs is None or self.prompt_logprobs >= 0
        assert 0 <= self.min_tokens <= self.max_tokens and self.repetition_penalty > 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


class TokenLogprobs(NamedTuple):
    """Log-probabilities under the model's own distribution (before temperature, top-k, top-p, penalties, bias)."""

    logprob: float  # of the token that was chosen (or, for a prompt token, the one that is there)
    top: tuple[tuple[int, float], ...]  # the most likely tokens, most likely first


class StopChecker(Protocol):
    """What ends a sequence on its text (stop strings): supplied by the layer that knows text, consulted
    by Sequence.append, so that a sequence's end is decided in one place whatever ends it."""

    def stops_at(self, token_id: int, may_stop: bool) -> bool:
        """Take the next generated token (every one, in order); whether the sequence ends with it.
        `may_stop` is False while the sequence is short of its min_tokens: the text goes on regardless."""
        ...


class ConstraintViolation(RuntimeError):
    """A sampled token the sequence's constraint does not accept."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    token_ids: list[int]  # prompt, then generated tokens
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: StopChecker | None = None
    # A sequence of the same prompt, added just before this one, whose full prompt blocks this one shares
    # instead of computing them (n completions of one prompt); None once it runs on its own.
    fork_of: "Sequence | None" = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    priority: int = 0  # lower is more urgent (generate/priority.py)
    tenant: str = ""  # whose request it is, for fair share (generate/fair_share.py); "": the shared tenant
    lora: "LoraAdapter | None" = None  # the LoRA adapter it runs through; None: the base model
    num_prompt_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "length" or "stop"; "error" (vLLM's) when deciding its end failed
    error: str | None = None  # why, with finish_reason "error": its request is answered with it
    seed: int = field(init=False)  # params.seed, or drawn: keys this sequence's sampling noise with each position
    # Its constraint's state: advanced only by tokens appended, so it survives preemption and recomputation.
    matcher: "llguidance.LLMatcher | None" = field(init=False)
    # KV state, owned by the block manager and the engine
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose keys/values are in the cache
    num_scheduled_tokens: int = 0  # tokens the current step computes: a prompt chunk, or the last token
    # Two counts of tokens it did not compute. Shared: at the head of its block table since its latest admission,
    # in blocks it shares (prefix-cache hits, or its leader's prompt blocks for a fork); its computing starts after
    # them. Cached prompt: prefix-cache hits at its first admission only (0 for a fork; None before it), what its
    # usage reports as cached (prompt_tokens_details.cached_tokens) however often it is preempted and readmitted.
    num_shared_tokens: int = 0
    num_cached_prompt_tokens: int | None = None
    num_committed_blocks: int = 0
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per generated token, if asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per prompt token after the first

    def __post_init__(self) -> None:
        assert self.token_ids, "a sequence needs at least one prompt token"
        self.num_prompt_tokens = len(self.token_ids)
        self.seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.matcher = self.params.constraint.matcher() if self.params.constraint is not None else None

    @property
    def lora_id(self) -> int:
        """Its adapter's id (0: the base model): keys its prefix-cache blocks, so adapters never share KV."""
        return 0 if self.lora is None else self.lora.id

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_new_tokens(self) -> int:
        """Tokens not yet in the cache: the rest of the prompt, or the last generated one."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def prompt_only(self) -> bool:
        """Computes its prompt (for the prompt's log-probabilities) and ends there."""
        return self.params.max_tokens == 0

    @property
    def samples_this_step(self) -> bool:
        """Whether the scheduled tokens reach the end, so the step gives this sequence a next token."""
        scheduled = self.num_scheduled_tokens
        end = self.num_computed_tokens + scheduled
        # max_tokens 0 is prompt_only, spelled out: read a few times a row and step, a property costs a call
        return scheduled > 0 and end == len(self.token_ids) and self.params.max_tokens != 0

    @property
    def reads_prefix_cache(self) -> bool:
        """A cached block holds keys and values, not logits: a sequence that still needs its prompt's
        log-probabilities computes its whole prompt (it may still fill the cache for others)."""
        return self.params.prompt_logprobs is None or len(self.prompt_logprobs) == self.num_prompt_tokens - 1

    def prompt_logprob_positions(self) -> range:
        """Positions of this step's chunk whose logits give a prompt token's log-probability not recorded yet:
        position p gives that of token p + 1 (a recomputation after preemption skips those it has)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        start = max(self.num_computed_tokens, len(self.prompt_logprobs))
        return range(start, min(self.num_computed_tokens + self.num_scheduled_tokens, self.num_prompt_tokens - 1))

    def logits_positions(self) -> list[int]:
        """Positions of this step's chunk whose logits the step needs: prompt log-probabilities first,
        then the last position when the step samples the next token."""
        positions = list(self.prompt_logprob_positions())
        if self.samples_this_step:
            positions.append(self.num_computed_tokens + self.num_scheduled_tokens - 1)
        return positions

    def leave_leader(self) -> None:
        """The sequence this one forked from has computed the shared blocks: take the prompt log-probabilities
        it has (the same prompt) and go on alone."""
        if self.params.prompt_logprobs is not None and self.fork_of is not None:
            self.prompt_logprobs = list(self.fork_of.prompt_logprobs)
        self.fork_of = None

    def append(self, token: int) -> None:
        """Record a sampled token and decide whether the sequence ends with it: end-of-text, the end of its
        constraint's grammar, a stop string (through the stop checker) or its length. This is the one place
        a sequence's end is decided. A failure in deciding it (its constraint refusing the token, its stop
        checker raising) is this sequence's alone: it ends with finish_reason "error" and the reason in
        `error`, and the engine retires it like any other, in the same step as the rest go on."""
        self.token_ids.append(token)
        try:
            self._decide_end(token)
        except Exception as err:  # noqa: BLE001 - whatever it is, it fails this request, not the loop
            log.exception("sequence %d failed at its token %d", self.seq_id, self.num_generated)
            self.error = f"{type(err).__name__}: {err}"
            self.end("error")

    def _decide_end(self, token: int) -> None:
        generated, params = self.num_generated, self.params  # once: this runs for every row of every step
        may_stop = generated >= params.min_tokens
        grammar_ended = self.matcher is not None and self._advance_matcher(token)
        if token == EOT_ID and (grammar_ended or (params.stop_at_eos and may_stop)):
            self.end("stop")  # the end-of-text token is no text: the stop checker never sees it
        elif (self.stop is not None and self.stop.stops_at(token, may_stop)) or grammar_ended:
            self.end("stop")
        elif generated >= params.max_tokens:
            self.end("length")

    def _advance_matcher(self, token: int) -> bool:
        """Feed the token to the constraint's matcher; whether the grammar has ended (it takes nothing more)."""
        # drawn from the matcher's own mask, so accepted, unless the matcher is in an error state (a grammar past
        # llguidance's limits at this step) or the logits were not numbers
        if not self.matcher.consume_token(token):
            raise ConstraintViolation(f"the constraint refused token {token}: {self.matcher.get_error()}")
        return self.matcher.is_stopped()

    def end(self, reason: str) -> None:
        self.finish_reason = reason
        self.status = Status.FINISHED
