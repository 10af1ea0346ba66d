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
"""

import bisect
import itertools
import time
from collections import Counter

from generate.fair_share import FairShare
from generate.priority import Rank
from generate.sequence import Sequence, Status
from kvcache.block_manager import BlockManager, KVCacheExhausted


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool,
        priority_aging_s: float = 0.0,
        priority_prefill_first: bool = False,
        fair_share: bool = False,
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
        self.fair_share = fair_share  # the order of admission and chunks follows the tenants' service
        self.fair = fair or FairShare()  # the tenants' counters, kept either way (for /stats and /metrics)
        self.max_loras = max_loras  # distinct LoRA adapters running at once; 0: no limit
        self._prefilling: int | None = None  # the most urgent priority with a prompt chunk in this step
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
        for seq in self.running:
            seq.num_scheduled_tokens = 0
        preempted = self._reserve_slots()
        budget = self.max_num_batched_tokens
        scheduled = []
        # A more urgent request at the head of the queue counts as prefilling: less urgent prompts
        # leave it the budget (with PRIORITY_PREFILL_FIRST), or it could wait for their whole prompts.
        self._prefilling = self.waiting[0].priority if self.waiting else None
        # decodes first (at most one token each, and running <= budget), then prompt chunks, most urgent first
        for seq in sorted(self.running, key=self._chunk_order):
            if self._waits_for_leader(seq) or self._held_back(seq):
                continue
            chunk = min(seq.num_new_tokens, budget)
            if chunk == 0:
                break
            self._note_prefill(seq)
            seq.num_scheduled_tokens = chunk
            budget -= chunk
            scheduled.append(seq)
        if not preempted:
            self._admit(scheduled, budget)
        self._charge(scheduled)
        return scheduled

    def schedule_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether the step after the current one can be `seqs` decoding again, decided before the current
        step's tokens are read (the engine's asynchronous scheduling); if so, a slot for one more token each.

        Only when that is what `schedule` would run: `seqs` are all the running sequences (no prompt chunk,
        no fork waiting), nobody waiting can be admitted or preempt one of them, and the pool has the slots
        without preempting (else the engine reads the tokens first and schedules the step itself).
        """
        if len(seqs) != len(self.running) or self._may_admit():
            return False
        try:
            for seq in seqs:
                self.blocks.append_slot(seq, ahead=1)
        except KVCacheExhausted:
            return False  # those given a block keep it: the token they make room for is on its way
        self._charge(seqs)
        return True

    def _may_admit(self) -> bool:
        """Whether the queue's next sequence could run in the next step: a seat is free, or it outranks a
        running sequence it could preempt."""
        if not self.waiting:
            return False
        return len(self.running) < self.max_num_seqs or bool(self._below(self._candidate()))

    def _charge(self, scheduled: list[Sequence]) -> None:
        for tenant, tokens in Counter(s.tenant for s in scheduled if s.samples_this_step).items():
            self.fair.charge(tenant, generated_tokens=tokens)  # once a tenant, not once a sequence

    def _chunk_order(self, seq: Sequence) -> tuple:
        """Decodes first (all of them fit the budget), then prompt chunks in rank order, or with fair share
        by priority, then the least-served tenant."""
        if seq.num_new_tokens > 1 and self._sharing:
            return (True, seq.priority, self.fair.service(seq.tenant), self.rank(seq))
        return (seq.num_new_tokens > 1, self.rank(seq))

    def _candidate(self) -> Sequence:
        """The waiting sequence admitted next: the head, or with fair share the least-served tenant's first
        at the head's priority."""
        head = self.waiting[0]
        return self.fair.pick(self.waiting, head.priority) if self._sharing else head

    @property
    def _sharing(self) -> bool:
        """Fair share is on and has tenants to share between."""
        return self.fair_share and len(self.fair.active) > 1

    def _reserve_slots(self) -> bool:
        """Give every running sequence room for its tokens, most urgent first, preempting the least urgent
        when blocks run out."""
        by_rank = sorted(self.running, key=self.rank)
        preempted, i = False, 0
        while i < len(by_rank):
            try:
                self.blocks.append_slot(by_rank[i])
            except KVCacheExhausted:
                self._preempt(by_rank.pop())  # the least urgent; may be by_rank[i] itself
                preempted = True
                continue
            i += 1
        return preempted

    def _admit(self, scheduled: list[Sequence], budget: int) -> None:
        """Admit waiting sequences in rank order while seats, blocks and budget last, preempting less urgent
        running ones for them; those that compute now join `scheduled` (where a preempted one leaves it)."""
        while self.waiting:
            seq = self._candidate()
            if not self._adapter_fits(seq):
                break
            leader = self._running_leader(seq)
            if leader is None and budget == 0:
                break  # a fork needs no budget until its leader has computed what they share
            blocks, tokens = self.blocks.fork_cost(seq) if leader else self.blocks.admission_cost(seq)
            if tokens > budget and not self.chunked_prefill:
                break  # strictly in rank order: nobody overtakes the head
            while not self._fits(blocks) and self._can_make_room(seq, blocks):
                budget += self._preempt_for(seq, scheduled)
            if not self._fits(blocks):
                break
            self.waiting.remove(seq)
            self._start(seq, leader)
            if not self._waits_for_leader(seq) and not self._held_back(seq):
                seq.num_scheduled_tokens = min(seq.num_new_tokens, budget)
                budget -= seq.num_scheduled_tokens
                if seq.num_scheduled_tokens:
                    self._note_prefill(seq)
                    scheduled.append(seq)

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether `seq`'s adapter is running already or one more adapter may run (MAX_LORAS)."""
        if not seq.lora_id or not self.max_loras:
            return True
        running = {s.lora_id for s in self.running} - {0}
        return seq.lora_id in running or len(running) < self.max_loras

    def _held_back(self, seq: Sequence) -> bool:
        """A prompt chunk that waits this step for a more urgent prompt's (PRIORITY_PREFILL_FIRST)."""
        more_urgent = self._prefilling is not None and seq.priority > self._prefilling
        return self.priority_prefill_first and seq.num_new_tokens > 1 and more_urgent

    def _note_prefill(self, seq: Sequence) -> None:
        if seq.num_new_tokens > 1:
            self._prefilling = seq.priority if self._prefilling is None else min(self._prefilling, seq.priority)

    def _fits(self, blocks: int) -> bool:
        """A seat, and `blocks` free blocks beyond a few kept back for the running sequences' next decodes."""
        reserve = self.watermark if self.running else 0
        return len(self.running) < self.max_num_seqs and blocks + reserve <= self.blocks.num_free_blocks

    def _can_make_room(self, seq: Sequence, blocks: int) -> bool:
        """Whether preempting every running sequence that ranks below `seq` would give it a seat and its
        blocks (counting their whole tables, some of which may be shared: a bound, not a promise)."""
        below = self._below(seq)
        seats = self.max_num_seqs - len(self.running) + len(below)
        held = sum(len(s.block_table) for s in below)
        reserve = self.watermark if len(self.running) > len(below) else 0
        return bool(below) and seats > 0 and blocks + reserve <= self.blocks.num_free_blocks + held

    def _below(self, seq: Sequence) -> list[Sequence]:
        """The running sequences `seq` may preempt: those ranking below it (with fair share, of another priority)."""
        below = [s for s in self.running if self.rank(s) > self.rank(seq)]
        return [s for s in below if s.priority != seq.priority] if self._sharing else below

    def _preempt_for(self, seq: Sequence, scheduled: list[Sequence]) -> int:
        """Preempt the least urgent running sequence for the more urgent `seq`; the budget it gave back."""
        victim = max(self._below(seq), key=self.rank)
        assert self.rank(victim) > self.rank(seq)
        tokens = victim.num_scheduled_tokens
        if victim in scheduled:
            scheduled.remove(victim)
        self._preempt(victim)
        self.num_priority_preemptions += 1
        return tokens

    def _start(self, seq: Sequence, leader: Sequence | None) -> None:
        """Give a waiting sequence its blocks (shared with its leader, or from the prefix cache) and a seat."""
        if leader:
            self.blocks.fork(seq, leader)
        else:
            self.blocks.allocate(seq)
            self.prompt_tokens_admitted += len(seq.token_ids)  # prefix-cache queries and hits; forks share
            self.prompt_tokens_cached += seq.num_cached_tokens
        if seq.num_cached_prompt_tokens is None:  # its first admission: its tenant pays for what it computes
            seq.num_cached_prompt_tokens = 0 if leader else seq.num_cached_tokens
            self.fair.charge(seq.tenant, prompt_tokens=len(seq.token_ids) - seq.num_cached_tokens)
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.status = Status.RUNNING
        self.running.append(seq)

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
        # Forks still waiting for this sequence's prompt (it was aborted part-way) compute their own.
        for fork in [s for s in self.running if s.fork_of is seq and self._waits_for_leader(s)]:
            self._requeue(fork)
