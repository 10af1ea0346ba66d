"""The engine: a model, its paged KV cache and a scheduler, advanced one step at a time."""

import logging
from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

from config import Settings
from generate.sampling import sample, top_logprobs
from generate.scheduler import Scheduler
from generate.sequence import SamplingParams, Sequence, Status, TokenLogprobs
from generate.step_input import build_step_batch
from kvcache.block_manager import BlockManager
from model.gpt2 import GPT
from model.loader import load_model
from model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class StepResult(NamedTuple):
    seq: Sequence
    token: int


class Engine:
    def __init__(self, model: GPT, num_blocks: int, settings: Settings, model_name: str = "", is_random: bool = False):
        self.model, self.model_name, self.is_random, self.settings = model, model_name, is_random, settings
        self.device = model.wte.weight.device
        self.max_context = model.config.n_positions
        self.blocks = BlockManager(num_blocks, settings.block_size, settings.prefix_cache)
        self.scheduler = Scheduler(self.blocks, settings.max_batch_size, settings.max_batch_tokens)
        model.allocate_kv_cache(num_blocks, settings.block_size)
        self.num_steps = 0

    @classmethod
    def from_settings(cls, settings: Settings) -> "Engine":
        device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = getattr(torch, settings.dtype or ("float16" if device.type == "cuda" else "float32"))
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
        return cls(loaded.model, num_blocks, settings, loaded.name, loaded.is_random)

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
        """Schedule, run the model once over every scheduled sequence, sample, retire finished."""
        seqs = self.scheduler.schedule()
        if not seqs:
            return []
        seqs.sort(key=lambda s: s.num_new_tokens == 1)  # prefills first, as the batch wants
        logits = self.model(build_step_batch(seqs, self.blocks.block_size, self.device))  # [N, V]
        sampled = sample(logits, *self._sampling_tensors(seqs))  # [N]
        self._record_logprobs(seqs, logits, sampled)
        tokens = sampled.tolist()
        self.num_steps += 1
        for seq, token in zip(seqs, tokens):
            seq.num_computed_tokens = len(seq.token_ids)
            self.blocks.commit(seq, seq.num_computed_tokens)
            seq.append(token)
            if seq.status is Status.FINISHED:
                self.scheduler.finish(seq)
        return [StepResult(s, t) for s, t in zip(seqs, tokens)]

    @staticmethod
    def _record_logprobs(seqs: list[Sequence], logits: torch.Tensor, sampled: torch.Tensor) -> None:
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return
        n = max(seqs[i].params.logprobs for i in rows)
        chosen, top_ids, top_values = top_logprobs(logits[rows], sampled[rows], n)
        for i, logprob, ids, values in zip(rows, chosen.tolist(), top_ids.tolist(), top_values.tolist()):
            k = seqs[i].params.logprobs
            seqs[i].logprobs.append(TokenLogprobs(logprob, tuple(zip(ids[:k], values[:k]))))

    def _sampling_tensors(self, seqs: list[Sequence]) -> tuple[torch.Tensor, ...]:
        params = [s.params for s in seqs]
        uniform = [float(torch.rand((), generator=s.generator)) if s.params.temperature > 0 else 0.0 for s in seqs]
        to = dict(device=self.device)
        return (
            torch.tensor([p.temperature for p in params], dtype=torch.float32, **to),
            torch.tensor([p.top_k for p in params], dtype=torch.long, **to),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, **to),
            torch.tensor(uniform, dtype=torch.float64, **to),
        )

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
