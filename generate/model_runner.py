"""Run GPT-2 over the scheduled sequences: build the flat batch, forward, sample, record logprobs."""

import torch

from generate.sampling import sample, top_logprobs
from generate.sequence import Sequence, TokenLogprobs
from generate.step_input import build_step_batch
from generate.step_log import StageClock
from model.gpt2 import GPT


class ModelRunner:
    """Owns the model and its KV cache tensor; the engine owns which slots each sequence uses."""

    def __init__(self, model: GPT, num_blocks: int, block_size: int):
        self.model, self.block_size = model, block_size
        self.device = model.wte.weight.device
        self.max_context = model.config.n_positions
        self.on_gpu = self.device.type == "cuda"
        model.allocate_kv_cache(num_blocks, block_size)

    def run(self, seqs: list[Sequence], clock: StageClock) -> list[int | None]:
        """One forward over every sequence's scheduled tokens (chunks first); the next token of each
        sequence whose chunk reaches its end, None for the others."""
        batch = build_step_batch(seqs, self.block_size, self.device)
        clock.lap("build")
        logits = self.model(batch)  # [N, V], N = sequences that sample
        clock.lap("forward")
        sampling = [s for s in seqs if s.samples_this_step]
        if not sampling:
            return [None] * len(seqs)
        sampled = sample(logits, *self._sampling_tensors(sampling))  # [N]
        self._record_logprobs(sampling, logits, sampled)
        tokens = iter(sampled.tolist())
        clock.lap("sample")
        return [next(tokens) if s.samples_this_step else None for s in seqs]

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
