"""The engine without the server: load a model, generate for a batch of prompts, read the outputs.

    from generate.llm import LLM, SamplingParams
    llm = LLM("random:gpt2")
    outputs = llm.generate(["The lighthouse keeper", "Once upon a time"], SamplingParams(temperature=0))

vLLM's offline interface, on this project's engine: the prompts go through the same scheduler, paged
KV cache (prefix cache included) and runner as the server's requests, all admitted together and
batched step by step (chunked prefill, preemption under memory pressure) until every one is done. What
the server adds, and this does not: HTTP, the batching modes (this is dynamic batching over one
batch), stop strings, structured output and `n` completions of one prompt.
"""

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from config import EngineSettings
from generate.engine import Engine
from generate.sequence import SamplingParams, Sequence, TokenLogprobs
from model.tokenizer import EOT_ID, encode_prompt, load_tokenizer

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

log = logging.getLogger(__name__)

Prompt = str | Seq[int]  # text, or token ids


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One prompt's completion, as vLLM names its parts."""

    index: int  # always 0: one completion per prompt
    text: str  # the generated tokens' text, without an end-of-text token that ended it
    token_ids: list[int]  # every generated token, an ending end-of-text included
    logprobs: list[TokenLogprobs] | None  # per generated token, when SamplingParams.logprobs is set
    finish_reason: str  # "stop" (end-of-text, with stop_at_eos) or "length"


@dataclass(frozen=True, slots=True)
class RequestOutput:
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs] | None  # per prompt token after the first, when asked for
    outputs: list[CompletionOutput]


class LLM:
    """One model, its KV cache and scheduler, in this process. `model` is what the server's MODEL setting
    takes: a hub name (`gpt2` … `gpt2-xl`), a checkpoint directory, `random:<name>` (seeded random
    weights, offline), or empty (gpt2-medium, falling back loudly to random weights offline). Other
    keyword arguments are EngineSettings fields (`dtype`, `device`, `kv_cache_blocks`, `max_batch_tokens`…)."""

    def __init__(self, model: str = "", **settings: object):
        self.settings = EngineSettings(model=model, **settings)
        self.engine = Engine.from_settings(self.settings)
        self.tokenizer = load_tokenizer()
        if self.engine.is_random:
            log.warning("%s: random weights, the output is gibberish", self.engine.model_name)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def generate(
        self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched together; the outputs in the prompts' order. One
        SamplingParams for all (default: SamplingParams()) or one per prompt."""
        prompts = [prompts] if _is_one_prompt(prompts) else list(prompts)
        params = params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        seqs = [Sequence(self._token_ids(prompt), p) for prompt, p in zip(prompts, params)]
        for seq in seqs:
            self.engine.add(seq)  # a prompt that can never fit is a ValueError here, before any step
        while self.engine.has_work():
            self.engine.step()
        return [self._output(prompt, seq) for prompt, seq in zip(prompts, seqs)]

    def _token_ids(self, prompt: Prompt) -> list[int]:
        ids = encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("a prompt needs at least one token")
        if not all(0 <= t < self.tokenizer.n_vocab for t in ids):
            raise ValueError(f"prompt token ids must be from 0 to {self.tokenizer.n_vocab - 1}")
        return ids

    def _output(self, prompt: Prompt, seq: Sequence) -> RequestOutput:
        ids = seq.completion_ids
        ended_by_eot = seq.finish_reason == "stop" and ids[-1:] == [EOT_ID]
        text = self.tokenizer.decode(ids[:-1] if ended_by_eot else ids)
        logprobs = seq.logprobs if seq.params.logprobs is not None else None
        completion = CompletionOutput(0, text, ids, logprobs, seq.finish_reason)
        prompt_logprobs = seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None
        prompt_text = prompt if isinstance(prompt, str) else None
        return RequestOutput(prompt_text, seq.token_ids[: seq.num_prompt_tokens], prompt_logprobs, [completion])


def _is_one_prompt(prompts: Prompt | Seq[Prompt]) -> bool:
    return isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
