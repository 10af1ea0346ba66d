"""Paged KV cache bookkeeping: a fixed pool of blocks, per-sequence block tables, refcounts.

Block lifetime has one owner, this class. A block is either referenced (by one or more
sequences; several only when shared through the prefix trie) or free: in the free queue, or spare. The
free queue is also the eviction order: blocks that hold cached prefixes wait at its tail
in least-recently-used order and keep their KV until they are reused; plain free blocks
wait at its head, so they are used before any cached block is evicted.

A sequence's blocks lie side by side where they can: attention reads each block's keys as a tile of its own,
and tiles in address order cost less to fetch (a decode's attention over 1,000 keys 19 % less on a Xeon). So a
sequence is admitted with the plain free blocks after its own kept spare for its growth (`room`), and a growing
sequence takes the block after its last one whenever that block is free and uncached. Spare blocks are free too:
they go to others once no plain free block is left, before any cached block is evicted.

Blocks are shared two ways: through the prefix trie, and by a fork (one of n completions of
one prompt), which shares its leader's full prompt blocks and computes only the block that
holds the prompt's last token, for its own logits. Both are plain references here.
"""

import itertools
from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from kvcache.prefix_trie import PrefixTrie


class KVCacheExhausted(Exception):
    """No free or evictable block is left in the pool."""


class SequenceBlocks(Protocol):
    token_ids: list[int]
    block_table: list[int]
    num_shared_tokens: int  # leading tokens in blocks shared at admission (prefix-cache hits, or a fork's leader's)
    num_committed_blocks: int  # leading full blocks already offered to the prefix cache
    reads_prefix_cache: bool  # False: compute every token (a cached block has no logits to give)
    lora_id: int  # the adapter its keys and values come from (0: the base model): the prefix cache's namespace


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._spare: OrderedDict[int, None] = OrderedDict()  # free, uncached, kept for the sequence before them
        self.trie = PrefixTrie(block_size) if prefix_cache else None
        self.evictions = 0
        self._num_evictable = 0  # free blocks still in the trie; a counter, as /stats reads it from other threads

    # --- capacity -------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: never used, freed, or cached but unreferenced."""
        return len(self._free) + len(self._spare)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.trie) if self.trie else 0

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable

    # --- sequences ------------------------------------------------------------------
    def _match(self, seq: SequenceBlocks) -> list[int]:
        if self.trie is None or not seq.reads_prefix_cache:
            return []
        # Leave at least one token to compute: its logits give the next token.
        return self.trie.match(seq.token_ids, max_blocks=self._num_shareable(seq), namespace=seq.lora_id)

    def _num_shareable(self, seq: SequenceBlocks) -> int:
        """Full blocks before the one holding the last token, which a sequence always computes itself."""
        return (len(seq.token_ids) - 1) // self.block_size

    def admission_cost(self, seq: SequenceBlocks) -> tuple[int, int]:
        """(free blocks that admitting `seq` would take, tokens it would have to compute)."""
        cached = self._match(seq)
        needed = self.blocks_for(len(seq.token_ids)) - len(cached)
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)  # cached, but in the free queue
        return needed + revived, len(seq.token_ids) - len(cached) * self.block_size

    def can_allocate(self, seq: SequenceBlocks, reserve: int = 0) -> bool:
        return self.admission_cost(seq)[0] + reserve <= self.num_free_blocks

    def allocate(self, seq: SequenceBlocks, room: int = 0) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing its cached prefix, and keep up to `room` free
        blocks after them spare for its growth."""
        assert not seq.block_table, "sequence already holds blocks"
        if not self.can_allocate(seq):
            raise KVCacheExhausted(f"{len(seq.token_ids)} tokens do not fit in {self.num_free_blocks} free blocks")
        cached = self._match(seq)
        for block in cached:
            self._acquire(block)
        seq.block_table = cached + [self._take_free() for _ in range(self.blocks_for(len(seq.token_ids)) - len(cached))]
        seq.num_shared_tokens = len(cached) * self.block_size
        seq.num_committed_blocks = len(cached)
        self._keep_spare(seq, room)

    def fork_cost(self, seq: SequenceBlocks) -> tuple[int, int]:
        """(free blocks, tokens to compute) of admitting `seq` as a fork of a running sequence of its prompt."""
        shared = self._num_shareable(seq)
        return self.blocks_for(len(seq.token_ids)) - shared, len(seq.token_ids) - shared * self.block_size

    def fork(self, seq: SequenceBlocks, leader: SequenceBlocks, room: int = 0) -> None:
        """Admit `seq`, whose prompt starts `leader`'s tokens, sharing the leader's full prompt blocks; its
        own blocks start after them. It must not compute until the leader has computed the shared ones."""
        assert not seq.block_table, "sequence already holds blocks"
        shared = self._num_shareable(seq)
        end = shared * self.block_size
        assert leader.token_ids[:end] == seq.token_ids[:end] and len(leader.block_table) >= shared
        assert leader.lora_id == seq.lora_id, "a fork runs through its leader's adapter"
        needed = self.blocks_for(len(seq.token_ids)) - shared
        if needed > self.num_free_blocks:
            raise KVCacheExhausted(f"a fork needs {needed} blocks, {self.num_free_blocks} are free")
        for block in leader.block_table[:shared]:
            self._acquire(block)
        seq.block_table = leader.block_table[:shared] + [self._take_free() for _ in range(needed)]
        seq.num_shared_tokens = end
        seq.num_committed_blocks = shared  # the leader offers the shared blocks to the prefix cache
        self._keep_spare(seq, room)

    def append_slot(self, seq: SequenceBlocks, num_tokens: int | None = None) -> None:
        """Make room for the sequence's last token, taking a new block at a block boundary: the last of its token
        list, or its `num_tokens`-th, which may lie one past the list (a slot needs a count, not the token). Tokens
        a grammar forced after the last one drawn may need more than one block (generate/engine.py's jump-forward);
        the blocks taken before the pool ran out are kept."""
        needed = self.blocks_for(len(seq.token_ids) if num_tokens is None else num_tokens)
        while len(seq.block_table) < needed:
            if not self.num_free_blocks:
                raise KVCacheExhausted("no free block for a decoding sequence")
            seq.block_table.append(self._take_next(seq.block_table[-1] + 1) if seq.block_table else self._take_free())
        assert len(seq.block_table) == needed

    def commit(self, seq: SequenceBlocks, num_computed_tokens: int) -> None:
        """Offer blocks filled by computed tokens to the prefix cache."""
        bs, full = self.block_size, num_computed_tokens // self.block_size
        if self.trie is None or full <= seq.num_committed_blocks:
            return  # most steps of a sequence fill no block
        for i in range(seq.num_committed_blocks, full):
            parent = seq.block_table[i - 1] if i else None
            self.trie.insert(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.block_table[i], seq.lora_id)
        seq.num_committed_blocks = full

    def free(self, seq: SequenceBlocks) -> None:
        # Its spare blocks are plain free ones again, after its own (which go to the head of the queue)
        after = seq.block_table[-1] + 1 if seq.block_table else self.num_blocks
        spare = list(itertools.takewhile(self._spare.__contains__, range(after, self.num_blocks)))
        for block in reversed(spare):
            del self._spare[block]
            self._free[block] = None
            self._free.move_to_end(block, last=False)
        # Deepest block first, so that among equally old blocks the tail of a prefix goes first.
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_committed_blocks = 0

    # --- the pool -------------------------------------------------------------------
    def _cached(self, block: int) -> bool:
        return self.trie is not None and block in self.trie

    def _keep_spare(self, seq: SequenceBlocks, room: int) -> None:
        """Keep the plain free blocks right after `seq`'s last one, up to `room` of them, spare for its growth."""
        after = seq.block_table[-1] + 1 if seq.block_table else self.num_blocks
        for block in range(after, min(after + room, self.num_blocks)):
            if block not in self._free or self._cached(block):
                break
            del self._free[block]
            self._spare[block] = None

    def _take_next(self, block: int) -> int:
        """`block` (the one after a growing sequence's last) if it is free and uncached, else the next free one."""
        if block in self._spare:
            del self._spare[block]
        elif block in self._free and not self._cached(block):
            del self._free[block]
        else:
            return self._take_free()
        self.ref_counts[block] = 1
        return block

    def _take_free(self) -> int:
        """The head of the free queue (plain free blocks first); spare blocks once no plain one is left, before any
        cached block is evicted."""
        if self._spare and (not self._free or self._cached(next(iter(self._free)))):
            block, _ = self._spare.popitem(last=False)
            self.ref_counts[block] = 1
            return block
        block, _ = self._free.popitem(last=False)
        if self._cached(block):
            for dropped in self.trie.remove(block):
                self.evictions += 1
                self._num_evictable -= 1
                if dropped != block:  # descendants are unreachable now: reuse them first
                    assert self.ref_counts[dropped] == 0
                    self._free.move_to_end(dropped, last=False)
        self.ref_counts[block] = 1
        return block

    def _acquire(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
            self._num_evictable -= 1  # only cached blocks are acquired while free
        self.ref_counts[block] += 1

    def _release(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} released twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None  # tail: most recently used
            if self._cached(block):
                self._num_evictable += 1
            else:
                self._free.move_to_end(block, last=False)

    def check_integrity(self, live: Iterable[SequenceBlocks]) -> None:
        """Refcounts equal real owners; no block both free and used; nothing leaked."""
        owners = [0] * self.num_blocks
        for seq in live:
            assert len(set(seq.block_table)) == len(seq.block_table), "a block appears twice in one table"
            assert len(seq.block_table) <= self.blocks_for(len(seq.token_ids))
            for block in seq.block_table:
                owners[block] += 1
        assert owners == self.ref_counts, "refcounts differ from the block tables"
        free = {b for b in range(self.num_blocks) if owners[b] == 0}
        assert free == set(self._free) | set(self._spare), "free queue differs from the unreferenced blocks"
        assert not set(self._free) & set(self._spare), "a block both spare and in the free queue"
        assert not any(self._cached(b) for b in self._spare), "a spare block holds a cached prefix"
        assert self._num_evictable == sum(1 for b in self._free if self._cached(b))
        if self.trie is not None:
            self.trie.check_integrity()
