"""The engine: a runner (the model, or a simulation of one), its paged KV cache and a scheduler,
advanced one step at a time."""

import logging
from collections.abc import Sequence as Seq
from typing import NamedTuple, Protocol

import torch

from config import Settings
from generate.model_runner import ModelRunner
from generate.scheduler import Scheduler
from generate.sequence import SamplingParams, Sequence, Status
from kvcache.block_manager import BlockManager
from model.gpt2 import GPT
from model.loader import load_model
from model.tokenizer import load_tokenizer
from sim.memory import sim_kv_blocks
from sim.runner import SimRunner

log = logging.getLogger(__name__)


class Runner(Protocol):
    """What computes a step: given the scheduled sequences (prefills first), the next token of each.

    It reads each sequence's block table and computed-token count, and records logprobs on
    the sequences that ask for them; the engine does all the bookkeeping around it.
    """

    max_context: int

    def run(self, seqs: list[Sequence]) -> list[int]: ...


class StepResult(NamedTuple):
    seq: Sequence
    token: int


class Engine:
    def __init__(
        self, runner: Runner, num_blocks: int, settings: Settings, model_name: str = "", is_random: bool = False
    ):
        if settings.max_batch_tokens < runner.max_context:  # prefills are not chunked
            raise ValueError(
                f"MAX_BATCH_TOKENS ({settings.max_batch_tokens}) must cover one full context of "
                f"{model_name or 'the model'} ({runner.max_context} tokens)"
            )
        self.runner, self.model_name, self.is_random, self.settings = runner, model_name, is_random, settings
        self.max_context = runner.max_context
        self.blocks = BlockManager(num_blocks, settings.block_size, settings.prefix_cache)
        self.scheduler = Scheduler(self.blocks, settings.max_batch_size, settings.max_batch_tokens)
        self.num_steps = 0

    @classmethod
    def from_settings(cls, settings: Settings) -> "Engine":
        if settings.engine == "sim":
            return cls.simulated(settings)
        device, dtype = device_and_dtype(settings)
        loaded = load_model(settings.model, device, dtype, settings.seed)
        num_blocks = kv_cache_blocks(settings, loaded.model, device, dtype)
        log.info(
            "model %s on %s/%s; KV cache: %d blocks of %d tokens",
            loaded.name,
            device,
            dtype,
            num_blocks,
            settings.block_size,
        )
        runner = ModelRunner(loaded.model, num_blocks, settings.block_size)
        return cls(runner, num_blocks, settings, loaded.name, loaded.is_random)

    @classmethod
    def simulated(cls, settings: Settings, announce: bool = True) -> "Engine":
        """ENGINE=sim: the real scheduler and KV bookkeeping over a runner that sleeps a cost model's step time."""
        runner = SimRunner.from_settings(settings)
        num_blocks = sim_kv_blocks(settings, runner.gpu, runner.model, runner.num_gpus)
        if announce:
            for line in (
                "=" * 72,
                f"SIMULATED ENGINE {runner.name}: no model runs, the tokens are deterministic filler.",
                "Each step sleeps for the time a cost model predicts: timings are a model, not a measurement.",
                f"KV cache: {num_blocks} blocks of {settings.block_size} tokens (GPU memory minus weights)",
                "=" * 72,
            ):
                log.warning(line)
        return cls(runner, num_blocks, settings, runner.name)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never run here, or None if it can."""
        total = num_prompt_tokens + max_tokens
        if total > self.max_context:
            return (
                f"prompt ({num_prompt_tokens} tokens) + max tokens ({max_tokens}) = {total} exceeds the "
                f"{self.max_context}-token context"
            )
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if total > capacity:
            return f"prompt + max tokens ({total}) exceeds the whole KV cache ({capacity} tokens)"
        return None

    def add(self, seq: Sequence) -> None:
        problem = self.check_fits(seq.num_prompt_tokens, seq.params.max_tokens)
        if problem:
            raise ValueError(problem)
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        if seq.status is not Status.FINISHED:
            self.scheduler.finish(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepResult]:
        """Schedule, run the model once over every scheduled sequence, retire finished."""
        seqs = self.scheduler.schedule()
        if not seqs:
            return []
        seqs.sort(key=lambda s: s.num_new_tokens == 1)  # prefills first, as the batch wants
        tokens = self.runner.run(seqs)
        assert len(tokens) == len(seqs)
        self.num_steps += 1
        for seq, token in zip(seqs, tokens):
            seq.num_computed_tokens = len(seq.token_ids)
            self.blocks.commit(seq, seq.num_computed_tokens)
            seq.append(token)
            if seq.status is Status.FINISHED:
                self.scheduler.finish(seq)
        return [StepResult(s, t) for s, t in zip(seqs, tokens)]

    def generate(self, prompts: Seq[Seq[int] | str], params: SamplingParams | Seq[SamplingParams]) -> list[list[int]]:
        """Generate for every prompt (token ids or text) through the scheduler; completions in order."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        tokenizer = load_tokenizer() if any(isinstance(p, str) for p in prompts) else None
        seqs = [Sequence(tokenizer.encode(p) if isinstance(p, str) else list(p), sp) for p, sp in zip(prompts, params)]
        for seq in seqs:
            self.add(seq)
        while self.has_work():
            self.step()
        return [seq.completion_ids for seq in seqs]


def device_and_dtype(settings: Settings) -> tuple[torch.device, torch.dtype]:
    """DEVICE and DTYPE, or their defaults: cuda if available, else cpu; float16 on cuda, float32 on cpu."""
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, getattr(torch, settings.dtype or ("float16" if device.type == "cuda" else "float32"))


def kv_cache_blocks(settings: Settings, model: GPT, device: torch.device, dtype: torch.dtype) -> int:
    """Blocks in the pool: KV_CACHE_BLOCKS, else KV_CACHE_GB, else 4 GB on CPU / 90% of free GPU memory."""
    if settings.kv_cache_blocks:
        return settings.kv_cache_blocks
    if settings.kv_cache_gb:
        budget = settings.kv_cache_gb * 2**30
    elif device.type == "cuda":
        budget = 0.9 * torch.cuda.mem_get_info(device)[0]
    else:
        budget = 4 * 2**30
    block_bytes = model.config.kv_bytes_per_token(dtype) * settings.block_size
    return max(1, int(budget // block_bytes))
