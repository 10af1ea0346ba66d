"""Run GPT-2 over the scheduled sequences: build the flat batch, forward, sample, record logprobs."""

import torch

from generate.sampling import sample, top_logprobs
from generate.sequence import Sequence, TokenLogprobs
from generate.step_input import build_step_batch
from model.gpt2 import GPT


class ModelRunner:
    """Owns the model and its KV cache tensor; the engine owns which slots each sequence uses."""

    def __init__(self, model: GPT, num_blocks: int, block_size: int):
        self.model, self.block_size = model, block_size
        self.device = model.wte.weight.device
        self.max_context = model.config.n_positions
        model.allocate_kv_cache(num_blocks, block_size)

    def run(self, seqs: list[Sequence]) -> list[int]:
        """One forward over every sequence's new tokens (prefills first); the next token of each."""
        logits = self.model(build_step_batch(seqs, self.block_size, self.device))  # [N, V]
        sampled = sample(logits, *self._sampling_tensors(seqs))  # [N]
        self._record_logprobs(seqs, logits, sampled)
        return sampled.tolist()

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
