"""Which sequences run in the next step, and how many tokens each computes in it.

Every step has a token budget (MAX_BATCH_TOKENS). Running sequences that decode take one
token each first, so a long prompt never stalls them; sequences part-way through their
prompt take chunks of what is left, in admission order; then waiting sequences are
admitted in arrival order while blocks and budget last, their first chunk in the same
step. Without chunked prefill a prompt is admitted only when all of it fits the budget.
A sequence gets blocks for its whole prompt at admission, so a prefill never stalls
half-way for memory. When a running sequence needs a block for its next token and none
is left, the least urgent running sequence (the latest to arrive, at equal priority) gives its
blocks back and goes back to the queue, at its old rank, to be recomputed later, so the most
urgent and oldest requests always progress.

Priorities (generate/priority.py): the queue is in rank order, so a more urgent request is
admitted first; when the head of the queue finds no seat or too few blocks, running sequences
that rank below it are preempted (recomputed later, as above) until it fits, so an urgent
request waits a step for a batch of less urgent ones, not for their end. Nothing else overtakes
the head: a request that does not fit blocks those behind it. While a prompt is being prefilled,
the prompt chunks of less urgent sequences wait (PRIORITY_PREFILL_FIRST; their decodes do not):
where a step's time grows with its tokens (a CPU), the urgent prompt's step is then short.

n completions of one prompt arrive as a leader followed by its forks. A fork admitted while
its leader runs shares the leader's full prompt blocks (BlockManager.fork) and waits, taking
no budget, until the leader has computed them; then it computes only its prompt's last,
partial block and goes on alone. The prompt is computed once, with or without the prefix
cache. A fork that cannot share (its leader gone, or itself preempted) computes its prompt
like any other sequence. A fork is admitted after its leader, so it is preempted before it.

Fair share between tenants (FAIR_SHARE, generate/fair_share.py): the head of the queue by rank
sets the priority admitted next, and among the waiting sequences of that priority the oldest of
the least-served tenant goes first (the candidate; nothing overtakes it either). Prompt chunks of
running sequences go by priority, then the least-served tenant, then rank. A candidate preempts
only running sequences of another priority that rank below it, never one of its own priority: a
tenant is served its share by admission, not by taking seats. Off, or with one tenant active, the
head itself is admitted and everything is as without fair share.

LoRA adapters: no more than MAX_LORAS distinct adapters run at once (the device has that many
slots, and every running sequence may be in one step), so a waiting sequence whose adapter would be
one too many waits, blocking those behind it, until a running adapter's sequences are all done.

`Scheduler.schedule` is one pass, in this order: room in the cache for the running sequences'
next tokens (preempting from the tail); forks settled with their leaders; the running sequences'
decodes and prompt chunks; admission from the queue, preempting less urgent running sequences for
a more urgent candidate. What the step has left to hand out (tokens, seats, blocks) is a
`StepBudget`. Words: `blocks` is the BlockManager, `num_blocks` a count of blocks; `leader` and
`fork` are sequences sharing prompt blocks; `fair` is the tenants' counters (FairShare) and
`fair_order` the FAIR_SHARE switch.
"""

import bisect
import itertools
import time
from collections.abc import Collection
from dataclasses import dataclass

from generate.fair_share import FairShare
from generate.priority import Rank
from generate.sequence import Sequence, Status
from kvcache.block_manager import BlockManager, KVCacheExhausted


@dataclass
class StepBudget:
    """What one step has left to hand out while it is scheduled (mini-sglang's PrefillAdder): tokens to
    compute, seats beside the running sequences, and free blocks beyond a few kept back (the watermark)
    while anything runs, so that the running sequences' next decodes do not at once preempt a newcomer.

    With PRIORITY_PREFILL_FIRST it hands prompt tokens to the most urgent prompts only: the prompt
    chunks of less urgent sequences wait a step, so the urgent prompt's step is short."""

    tokens: int  # MAX_BATCH_TOKENS less the tokens scheduled so far
    running: list[Sequence]  # the scheduler's running sequences, a seat each (read live)
    max_running: int
    blocks: BlockManager  # its free blocks are read live: admissions take some, preemptions give some back
    watermark: int
    prefill_first: bool = False  # PRIORITY_PREFILL_FIRST
    prefilling: int | None = None  # the most urgent priority with a prompt chunk in this step

    def fits(self, num_blocks: int, freeing: Collection[Sequence] = ()) -> bool:
        """Whether a candidate needing `num_blocks` free blocks has a seat and its blocks, once the running
        sequences `freeing` were preempted (their whole tables counted, some of which may be shared: a bound,
        not a promise)."""
        running = len(self.running) - len(freeing)
        reserve = self.watermark if running else 0
        held = sum(len(s.block_table) for s in freeing)
        return running < self.max_running and num_blocks + reserve <= self.blocks.num_free_blocks + held

    def held_back(self, seq: Sequence) -> bool:
        """A prompt chunk that waits this step for a more urgent prompt's (PRIORITY_PREFILL_FIRST)."""
        if not self.prefill_first:
            return False
        more_urgent = self.prefilling is not None and seq.priority > self.prefilling
        return seq.num_new_tokens > 1 and more_urgent

    def take(self, seq: Sequence) -> Sequence:
        """Schedule as much of `seq`'s new tokens as the budget has (there are some left)."""
        new = seq.num_new_tokens
        assert self.tokens > 0 and new > 0
        seq.num_scheduled_tokens = min(new, self.tokens)
        self.tokens -= seq.num_scheduled_tokens
        if new > 1:  # a prompt chunk
            self.prefilling = seq.priority if self.prefilling is None else min(self.prefilling, seq.priority)
        return seq


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool,
        priority_aging_s: float = 0.0,
        priority_prefill_first: bool = False,
        fair_order: bool = False,
        fair: FairShare | None = None,
        max_loras: int = 0,
    ):
        # Every running sequence decodes one token per step, so no more may run than the budget has tokens.
        assert 1 <= max_num_seqs <= max_num_batched_tokens
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.priority_aging_s = priority_aging_s
        self.priority_prefill_first = priority_prefill_first
        self.fair_order = fair_order  # FAIR_SHARE: admission and prompt chunks follow the tenants' service
        self.fair = fair or FairShare()  # the tenants' counters, kept either way (for /stats and /metrics)
        self.max_loras = max_loras  # distinct LoRA adapters running at once; 0: no limit
        # Keep a few blocks back when admitting beside running sequences, so that their
        # next decode steps do not immediately preempt the newcomer.
        self.watermark = blocks.num_blocks // 100
        self.waiting: list[Sequence] = []  # in rank order, most urgent first
        self.running: list[Sequence] = []  # in admission order, oldest first
        self._ranks: dict[int, Rank] = {}  # seq id -> its rank, fixed when added
        self._added = itertools.count()
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # of those, for a more urgent waiting sequence
        self.prompt_tokens_admitted = 0
        self.prompt_tokens_cached = 0

    def add(self, seq: Sequence) -> None:
        assert self.blocks.blocks_for(len(seq.token_ids) + seq.params.max_tokens) <= self.blocks.num_blocks
        self._ranks[seq.seq_id] = Rank.of(seq.priority, time.monotonic(), next(self._added), self.priority_aging_s)
        self.fair.arrive(seq.tenant)
        self._enqueue(seq)

    def rank(self, seq: Sequence) -> Rank:
        return self._ranks[seq.seq_id]

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=self.rank)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """Reserve cache slots for the next step; the sequences to run, each with its num_scheduled_tokens set."""
        # Room for every running sequence's next token, most urgent first. When the pool runs out, the least
        # urgent gives its blocks back to be recomputed later (it may be the one asking): nobody is admitted.
        for seq in self.running:
            seq.num_scheduled_tokens = 0
        by_rank, preempted, i = sorted(self.running, key=self.rank), False, 0
        while i < len(by_rank):
            try:
                self.blocks.append_slot(by_rank[i])
                i += 1
            except KVCacheExhausted:
                self._preempt(by_rank.pop())
                preempted = True
        # Forks and leaders: a running fork whose leader has computed the blocks they share goes on alone (one
        # that keeps its leader waits for it); a waiting fork whose leader has left the scheduler (ended,
        # aborted) will compute its prompt itself.
        for seq in self.running:
            if seq.fork_of is not None and self._leader_done(seq):
                seq.leave_leader()
        for seq in self.waiting:
            if seq.fork_of is not None and seq.fork_of.seq_id not in self._ranks:
                seq.fork_of = None

        budget = StepBudget(self.max_num_batched_tokens, self.running, self.max_num_seqs, self.blocks, self.watermark)
        # A more urgent request at the head of the queue counts as prefilling: less urgent prompts leave it
        # the budget (with PRIORITY_PREFILL_FIRST), or it could wait for their whole prompts.
        budget.prefill_first = self.priority_prefill_first
        budget.prefilling = self.waiting[0].priority if self.waiting else None
        scheduled = []
        # The running: decodes first (one token each, and running <= budget), then prompt chunks, most urgent first.
        # by_rank holds the running in rank order: the decodes' order as it is, only the chunks' to sort.
        assert len(by_rank) == len(self.running)
        decodes, chunks = [], []
        for seq in by_rank:
            (chunks if seq.num_new_tokens > 1 else decodes).append(seq)
        for seq in decodes + sorted(chunks, key=self._chunk_order):
            if budget.tokens == 0:
                break
            if seq.fork_of is None and not budget.held_back(seq):
                scheduled.append(budget.take(seq))

        # Admission: the candidate (the head of the queue, or with fair share the least-served tenant's first
        # at the head's priority) while seats, blocks and tokens last; nobody overtakes it.
        while self.waiting and not preempted:
            seq = self._candidate()
            leader = seq.fork_of
            assert leader is None or leader.status is Status.RUNNING, "a fork ranks after its leader"
            if not self._adapter_fits(seq) or (leader is None and budget.tokens == 0):
                break  # one adapter too many, or no tokens (a fork takes none until its leader computed them)
            num_blocks, num_tokens = self.blocks.fork_cost(seq) if leader else self.blocks.admission_cost(seq)
            if num_tokens > budget.tokens and not self.chunked_prefill:
                break  # the whole prompt in one step, or wait
            # Short of a seat or blocks, it takes them from running sequences that rank below it, the least
            # urgent first, while preempting all of those could make room.
            while not budget.fits(num_blocks) and budget.fits(num_blocks, freeing=(below := self._below(seq))):
                victim = max(below, key=self.rank)
                assert self.rank(victim) > self.rank(seq)
                budget.tokens += victim.num_scheduled_tokens
                if victim in scheduled:
                    scheduled.remove(victim)
                self._preempt(victim)
                self.num_priority_preemptions += 1
                if not leader:  # the victim's blocks that hold the candidate's cached prefix are free now: they count
                    num_blocks = self.blocks.admission_cost(seq)[0]
            if not budget.fits(num_blocks):
                break
            self.waiting.remove(seq)
            self._admit(seq, leader)
            if leader is not None and self._leader_done(seq):
                seq.leave_leader()
            if seq.fork_of is None and not budget.held_back(seq) and budget.tokens > 0:
                scheduled.append(budget.take(seq))
        self.charge(scheduled)
        return scheduled

    def runs_alone(self, seqs: list[Sequence]) -> bool:
        """Whether `seqs` are all the running sequences and nobody waiting can join or preempt them now: the
        queue's next sequence has no seat and outranks none of them."""
        if len(seqs) != len(self.running):
            return False
        return not self.waiting or (len(self.running) >= self.max_num_seqs and not self._below(self._candidate()))

    def charge(self, scheduled: list[Sequence]) -> None:
        """Charge each tenant for the tokens its scheduled sequences draw (fair share's service)."""
        generated: dict[str, int] = {}
        for seq in scheduled:
            if seq.samples_this_step:
                generated[seq.tenant] = generated.get(seq.tenant, 0) + 1
        for tenant, tokens in generated.items():
            self.fair.charge(tenant, generated_tokens=tokens)  # once a tenant, not once a sequence

    def _chunk_order(self, seq: Sequence) -> tuple:
        """Prompt chunks in rank order, or with fair share by priority, then the least-served tenant."""
        if self._fair_now:
            return (seq.priority, self.fair.service(seq.tenant), self.rank(seq))
        return (self.rank(seq),)

    def _candidate(self) -> Sequence:
        """The waiting sequence admitted next: the head, or with fair share the least-served tenant's first
        at the head's priority."""
        head = self.waiting[0]
        return self.fair.pick(self.waiting, head.priority) if self._fair_now else head

    @property
    def _fair_now(self) -> bool:
        """Fair share orders this step: FAIR_SHARE is on and more than one tenant has sequences."""
        return self.fair_order and len(self.fair.active) > 1

    def _below(self, seq: Sequence) -> list[Sequence]:
        """The running sequences `seq` may preempt: those ranking below it (with fair share, of another priority)."""
        below = [s for s in self.running if self.rank(s) > self.rank(seq)]
        return [s for s in below if s.priority != seq.priority] if self._fair_now else below

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether `seq`'s adapter is running already or one more adapter may run (MAX_LORAS)."""
        if not seq.lora_id or not self.max_loras:
            return True
        running = {s.lora_id for s in self.running} - {0}
        return seq.lora_id in running or len(running) < self.max_loras

    @staticmethod
    def _leader_done(fork: Sequence) -> bool:
        """Whether `fork`'s leader has computed the prompt blocks they share (then the fork goes on alone)."""
        return fork.fork_of.num_computed_tokens >= fork.num_shared_tokens

    def _admit(self, seq: Sequence, leader: Sequence | None) -> None:
        """Give a waiting sequence its blocks (shared with its leader, or from the prefix cache) and a seat."""
        # blocks it may still grow into, kept spare after its own so that they lie side by side
        room = self.blocks.blocks_for(seq.num_prompt_tokens + seq.params.max_tokens) - self.blocks.blocks_for(
            len(seq.token_ids)
        )
        if leader:
            self.blocks.fork(seq, leader, room)
        else:
            self.blocks.allocate(seq, room)
            self.prompt_tokens_admitted += len(seq.token_ids)  # prefix-cache queries and hits; forks share
            self.prompt_tokens_cached += seq.num_shared_tokens
        if seq.num_cached_prompt_tokens is None:  # its first admission: its tenant pays for what it computes
            seq.num_cached_prompt_tokens = 0 if leader else seq.num_shared_tokens
            self.fair.charge(seq.tenant, prompt_tokens=len(seq.token_ids) - seq.num_shared_tokens)
        seq.num_computed_tokens = seq.num_shared_tokens
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        """Give a running sequence's blocks back and put it back in the queue at its rank, to be recomputed."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = seq.num_scheduled_tokens = 0
        seq.fork_of = None  # its shared blocks are gone: it computes its prompt itself
        seq.status = Status.WAITING
        self._enqueue(seq)

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out, giving its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        if self._ranks.pop(seq.seq_id, None) is not None:
            self.fair.leave(seq.tenant)
        seq.status = Status.FINISHED
        # Its running forks go on alone if it computed the blocks they share; if not (it was aborted
        # part-way), they compute their prompts themselves.
        for fork in [s for s in self.running if s.fork_of is seq]:
            if self._leader_done(fork):
                fork.leave_leader()
            else:
                self._requeue(fork)
