"""Which sequences run in the next step, and how many tokens each computes in it.

Every step has a token budget (MAX_BATCH_TOKENS). Running sequences that decode take one
token each first, so a long prompt never stalls them; sequences part-way through their
prompt take chunks of what is left, in admission order; then waiting sequences are
admitted in arrival order while blocks and budget last, their first chunk in the same
step. Without chunked prefill a prompt is admitted only when all of it fits the budget.
A sequence gets blocks for its whole prompt at admission, so a prefill never stalls
half-way for memory. When a running sequence needs a block for its next token and none
is left, the most recently admitted sequence gives its blocks back and goes to the front
of the queue to be recomputed later, so the oldest requests always progress.

n completions of one prompt arrive as a leader followed by its forks. A fork admitted while
its leader runs shares the leader's full prompt blocks (BlockManager.fork) and waits, taking
no budget, until the leader has computed them; then it computes only its prompt's last,
partial block and goes on alone. The prompt is computed once, with or without the prefix
cache. A fork that cannot share (its leader gone, or itself preempted) computes its prompt
like any other sequence. A fork is admitted after its leader, so it is preempted before it.
"""

from collections import deque

from generate.sequence import Sequence, Status
from kvcache.block_manager import BlockManager, KVCacheExhausted


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, chunked_prefill: bool):
        # Every running sequence decodes one token per step, so no more may run than the budget has tokens.
        assert 1 <= max_num_seqs <= max_num_batched_tokens
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
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
        """Reserve cache slots for the next step; the sequences to run, each with its num_scheduled_tokens set."""
        for seq in self.running:
            seq.num_scheduled_tokens = 0
        preempted = self._reserve_slots()
        budget = self.max_num_batched_tokens
        scheduled = []
        # decodes first (at most one token each, and running <= budget), then prompt chunks
        for seq in sorted(self.running, key=lambda s: s.num_new_tokens > 1):
            if self._waits_for_leader(seq):
                continue
            chunk = min(seq.num_new_tokens, budget)
            if chunk == 0:
                break
            seq.num_scheduled_tokens = chunk
            budget -= chunk
            scheduled.append(seq)
        if not preempted:
            scheduled += self._admit(budget)
        return scheduled

    def _reserve_slots(self) -> bool:
        """Give every running sequence room for its tokens, preempting the newest when blocks run out."""
        preempted, i = False, 0
        while i < len(self.running):
            try:
                self.blocks.append_slot(self.running[i])
            except KVCacheExhausted:
                self._preempt(self.running[-1])  # the newest; may be running[i] itself
                preempted = True
                continue
            i += 1
        return preempted

    def _admit(self, budget: int) -> list[Sequence]:
        """Admit waiting sequences in order while seats, blocks and budget last; those that compute now."""
        scheduled = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            leader = self._running_leader(seq)
            if leader is None and budget == 0:
                break  # a fork needs no budget until its leader has computed what they share
            reserve = self.watermark if self.running else 0
            blocks, tokens = self.blocks.fork_cost(seq) if leader else self.blocks.admission_cost(seq)
            if (tokens > budget and not self.chunked_prefill) or blocks + reserve > self.blocks.num_free_blocks:
                break  # strictly first come, first served: nobody overtakes the head
            self.waiting.popleft()
            if leader:
                self.blocks.fork(seq, leader)
            else:
                self.blocks.allocate(seq)
                self.prompt_tokens_admitted += len(seq.token_ids)  # prefix-cache queries and hits; forks share
                self.prompt_tokens_cached += seq.num_cached_tokens
            if seq.num_cached_prompt_tokens is None:
                seq.num_cached_prompt_tokens = 0 if leader else seq.num_cached_tokens
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            if not self._waits_for_leader(seq):
                seq.num_scheduled_tokens = min(seq.num_new_tokens, budget)
                budget -= seq.num_scheduled_tokens
                if seq.num_scheduled_tokens:
                    scheduled.append(seq)
        return scheduled

    @staticmethod
    def _running_leader(seq: Sequence) -> Sequence | None:
        """The running sequence whose prompt blocks `seq` can share; None (and `seq` on its own) if none."""
        if seq.fork_of is not None and seq.fork_of.status is not Status.RUNNING:
            seq.fork_of = None  # its leader has gone: it computes its prompt itself
        return seq.fork_of

    @staticmethod
    def _waits_for_leader(seq: Sequence) -> bool:
        """Whether `seq` still waits for its leader to compute the blocks they share (then it leaves it)."""
        if seq.fork_of is None:
            return False
        if seq.fork_of.num_computed_tokens < seq.num_cached_tokens:
            return True
        seq.leave_leader()
        return False

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        """Give a running sequence's blocks back and put it at the front of the queue, to be recomputed."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = seq.num_scheduled_tokens = 0
        seq.fork_of = None  # its shared blocks are gone: it computes its prompt itself
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out, giving its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        # Forks still waiting for this sequence's prompt (it was aborted part-way) compute their own.
        for fork in [s for s in self.running if s.fork_of is seq and self._waits_for_leader(s)]:
            self._requeue(fork)
