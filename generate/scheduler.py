"""Which sequences run in the next step: first come, first served, preempting under pressure.

Every step each running sequence gets a cache slot for its next token (decode), then
waiting sequences are admitted in arrival order while blocks and the token budget last
(prefill). Prefills and decodes share the step. When a running sequence needs a block
and none is left, the most recently admitted sequence gives its blocks back and goes to
the front of the queue to be recomputed later, so the oldest requests always progress.
"""

from collections import deque

from generate.sequence import Sequence, Status
from kvcache.block_manager import BlockManager, KVCacheExhausted


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Keep a few blocks back when admitting beside running sequences, so that their
        # next decode steps do not immediately preempt the newcomer.
        self.watermark = blocks.num_blocks // 100
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order, oldest first
        self.num_preemptions = 0
        self.prompt_tokens_admitted = 0
        self.prompt_tokens_cached = 0

    def add(self, seq: Sequence) -> None:
        assert self.blocks.blocks_for(len(seq.token_ids) + seq.params.max_tokens) <= self.blocks.num_blocks
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """Reserve cache slots for the next step and return the sequences to run in it."""
        scheduled, preempted = self._schedule_decodes()
        if not preempted:
            scheduled += self._admit(budget=self.max_num_batched_tokens - len(scheduled))
        return scheduled

    def _schedule_decodes(self) -> tuple[list[Sequence], bool]:
        scheduled, preempted, i = [], False, 0
        while i < len(self.running):
            seq = self.running[i]
            try:
                self.blocks.append_slot(seq)
            except KVCacheExhausted:
                self._preempt(self.running[-1])  # the newest; may be `seq` itself
                preempted = True
                continue
            scheduled.append(seq)
            i += 1
        return scheduled, preempted

    def _admit(self, budget: int) -> list[Sequence]:
        admitted = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            reserve = self.watermark if self.running else 0
            blocks, tokens = self.blocks.admission_cost(seq)
            if tokens > budget or blocks + reserve > self.blocks.num_free_blocks:
                break  # strictly first come, first served: nobody overtakes the head
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            budget -= seq.num_new_tokens
            self.prompt_tokens_admitted += len(seq.token_ids)
            self.prompt_tokens_cached += seq.num_cached_tokens
        return admitted

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out, giving its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
