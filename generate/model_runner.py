"""Run GPT-2 over the scheduled sequences: build the flat batch, forward, then the sampler."""

from generate.sampler import Sampler
from generate.sequence import Sequence
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
        self.sampler = Sampler(self.device)
        model.allocate_kv_cache(num_blocks, block_size)

    def run(self, seqs: list[Sequence], clock: StageClock) -> list[int | None]:
        """One forward over every sequence's scheduled tokens (chunks first); the next token of each
        sequence whose chunk reaches its end, None for the others."""
        batch = build_step_batch(seqs, self.block_size, self.device)
        clock.lap("build")
        logits = self.model(batch)  # [N, V]: the rows each sequence asks for (Sequence.logits_positions)
        clock.lap("forward")
        tokens = self.sampler(seqs, logits)
        clock.lap("sample")
        return tokens
