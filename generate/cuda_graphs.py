"""Decode steps replayed from CUDA graphs, one captured per batch size of a ladder.

A decode step of gpt2-medium is a few hundred small kernels; launched one by one from
Python, the GPU waits on the launches. A graph records them once and replays them with one
launch. A graph replays fixed tensor addresses and shapes, so every input lives in a static
buffer sized for the largest batch: a step of n sequences uses the smallest captured size
>= n, its rows beyond n are padding that writes its key/value to the scratch block and
attends over that one key. Embedding, layers, final norm and the LM head are all inside
the graph; prefill and mixed steps run eagerly. With capture off ("eager") the same static
buffers run the model directly: how the bucket choice, padding and filling are tested on CPU.
"""

import torch

from generate.sequence import Sequence
from generate.step_input import upload
from model.attention import PagedInputs
from model.gpt2 import GPT, StepBatch
from model.triton_attention import TritonAttention


def batch_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: GPT, max_batch: int, block_size: int, scratch_block: int):
        self.model, self.block_size, self.scratch_block = model, block_size, scratch_block
        self.sizes = batch_ladder(max_batch)
        self.max_blocks = -(-model.config.n_positions // block_size)
        device = model.wte.weight.device
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slot_mapping = zeros(max_batch), zeros(max_batch), zeros(max_batch)
        self.context_lens = zeros(max_batch)  # [Bmax]
        self.block_tables = zeros(max_batch, self.max_blocks)  # [Bmax, W]
        self.query_start = torch.arange(max_batch + 1, device=device)  # one query row per sequence, always
        self.logits = torch.zeros((max_batch, model.config.vocab_size), dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0

    def fits(self, seqs: list[Sequence]) -> bool:
        """A step the graphs can run: every sequence computes one token and samples, and there are few enough."""
        return len(seqs) <= self.sizes[-1] and all(s.num_scheduled_tokens == 1 and s.samples_this_step for s in seqs)

    def bucket(self, n: int) -> int:
        return next(size for size in self.sizes if size >= n)

    def prepare(
        self, seqs: list[Sequence], positions: list[int] | None = None, input_ids: torch.Tensor | None = None
    ) -> None:
        """Fill the static buffers for these sequences and pad them up to their bucket, in one host-to-device copy.

        Each row computes one token: by default its sequence's last, at that token's position; else the row's
        `input_ids` ([n], on the device: tokens the host need not have) at its `positions`. Either way the slot of
        the row's position is in its sequence's block table.
        """
        assert (positions is None) == (input_ids is None), "both given, or neither"
        n, size, bs = len(seqs), self.bucket(len(seqs)), self.block_size
        padding = size - n
        if positions is None:
            positions = [len(s.token_ids) - 1 for s in seqs]
        host_ids = [s.token_ids[-1] for s in seqs] if input_ids is None else [0] * n  # given ids: copied in below
        width = max(-(-(p + 1) // bs) for p in positions)
        tables = [s.block_table[:width] + [0] * (width - len(s.block_table[:width])) for s in seqs]
        t = upload(
            self.logits.device,
            input_ids=host_ids + [0] * padding,
            positions=positions + [0] * padding,
            slot_mapping=[s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
            + [self.scratch_block * bs] * padding,
            context_lens=[p + 1 for p in positions] + [1] * padding,
            block_tables=[b for row in tables for b in row] + ([self.scratch_block] + [0] * (width - 1)) * padding,
        )
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            getattr(self, name)[:size].copy_(t[name])
        if input_ids is not None:
            self.input_ids[:n].copy_(input_ids)  # device to device, queued behind whatever writes them
        # columns past `width` keep stale ids: the kernel reads no block beyond a sequence's context
        self.block_tables[:size, :width].copy_(t["block_tables"].view(size, width))

    def replay(self, n: int) -> torch.Tensor:
        """Logits of the first n rows of the prepared batch."""
        size = self.bucket(n)
        self.num_replays += 1
        if size in self.graphs:
            self.graphs[size].replay()
        else:
            self.logits[:size] = self.model(self._static_batch(size))
        return self.logits[:n]  # [n, V]

    def capture(self) -> None:
        """Capture every size, largest first, so the smaller graphs reuse the first one's memory pool."""
        pool = None
        for size in reversed(self.sizes):
            self.context_lens[:size] = 1
            self.block_tables[:size, 0] = self.scratch_block
            self.slot_mapping[:size] = self.scratch_block * self.block_size
            batch = self._static_batch(size)
            self.logits[:size] = self.model(batch)  # warm-up: compiles the kernel, settles the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[:size] = self.model(batch)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def _static_batch(self, size: int) -> StepBatch:
        paged = PagedInputs(self.query_start[: size + 1], self.context_lens[:size], self.block_tables[:size], 1)
        attention = TritonAttention(paged)
        return StepBatch(self.input_ids[:size], self.positions[:size], self.slot_mapping[:size], attention, None)
