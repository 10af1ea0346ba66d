"""SimRunner: the model runner's interface, with a cost model's step time and deterministic tokens.

Everything around it is real: the scheduler, the block manager and its prefix trie, the
batching manager, the API. Only the model is replaced: a step sleeps for the time the cost
model gives the scheduled sequences on the simulated GPUs, then returns, for each sequence,
a token that depends only on its last token and its length. That token is never
<|endoftext|>, so every request runs to its max_tokens, and temperature, top-k, top-p,
penalties, logit bias and seed change nothing. The text is GPT-2-tokenizer filler whatever
model is simulated: the simulation is of time and memory, not of words. A constrained
sequence (structured output) takes the first token its grammar allows from that choice on.
"""

import time
from collections.abc import Callable

import numpy as np

from config import EngineSettings
from generate.grammar_mask import StepMasks
from generate.sequence import Sequence, TokenLogprobs
from generate.step_log import StageClock
from model.tokenizer import EOT_ID
from sim.cost import StepCost, step_cost
from sim.profiles import GpuProfile, ModelProfile, load_gpu, load_model


def next_token(token_ids: list[int]) -> int:
    """The simulated model's choice: a cheap mix of the last token and the position, below EOT_ID."""
    return (token_ids[-1] * 7919 + len(token_ids) * 104729) % EOT_ID


class SimRunner:
    def __init__(
        self, gpu: GpuProfile, model: ModelProfile, num_gpus: int = 1, sleep: Callable[[float], None] = time.sleep
    ):
        self.gpu, self.model, self.num_gpus, self.sleep = gpu, model, num_gpus, sleep
        self.max_context = model.context_len
        self.on_gpu = True  # simulated GPUs: the GPU default token budget
        gpus = f"{num_gpus}x{gpu.name}" if num_gpus > 1 else gpu.name
        self.name = f"sim:{model.name}@{gpus}"  # reported everywhere, so no one takes the timings for real ones
        self.simulated_s = 0.0  # total step time slept so far

    @classmethod
    def from_settings(cls, settings: EngineSettings, sleep: Callable[[float], None] = time.sleep) -> "SimRunner":
        model = load_model(settings.sim_model, settings.dtype, settings.kv_cache_dtype)
        return cls(load_gpu(settings.sim_gpu), model, settings.sim_num_gpus, sleep)

    def cost(self, seqs: list[Sequence]) -> StepCost:
        chunks = [(s.num_scheduled_tokens, s.num_computed_tokens + s.num_scheduled_tokens) for s in seqs]
        return step_cost(self.gpu, self.model, chunks, self.num_gpus)

    def run(self, seqs: list[Sequence], clock: StageClock, masks: StepMasks | None = None) -> list[int | None]:
        seconds = self.cost(seqs).total_s
        clock.lap("build")
        self.sleep(seconds)
        self.simulated_s += seconds
        clock.lap("forward")
        tokens = [next_token(s.token_ids) if s.samples_this_step else None for s in seqs]
        if masks is not None:
            _keep_within(tokens, masks.wait())
            clock.lap("mask")
        for seq, token in zip(seqs, tokens):
            # The simulated model is deterministic: every token it sees or chooses has probability 1.
            positions, top_n = seq.prompt_logprob_positions(), seq.params.prompt_logprobs
            seq.prompt_logprobs += [_certain(seq.token_ids[p + 1], top_n) for p in positions]
            if token is not None and seq.params.logprobs is not None:
                seq.logprobs.append(_certain(token, seq.params.logprobs))
        clock.lap("sample")
        return tokens


def _keep_within(tokens: list[int | None], masks: StepMasks) -> None:
    """A constrained row takes the first token its grammar allows at or after the simulated choice
    (wrapping round the vocabulary), so structured output works on the simulated engine too."""
    sampling = [i for i, token in enumerate(tokens) if token is not None]
    for k, row in enumerate(masks.rows):
        i, allowed = sampling[row], masks.allowed(k)
        tokens[i] = int(allowed[np.searchsorted(allowed, tokens[i]) % len(allowed)])


def _certain(token: int, top_n: int | None) -> TokenLogprobs:
    return TokenLogprobs(0.0, ((token, 0.0),) if top_n else ())
