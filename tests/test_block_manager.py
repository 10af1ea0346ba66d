"""BlockManager: allocation, append, exhaustion, free and reuse, integrity, and the prefix cache."""

from dataclasses import dataclass, field

import pytest

from kvcache.block_manager import BlockManager, KVCacheExhausted

BS = 4


@dataclass
class FakeSeq:  # exactly the SequenceBlocks protocol
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_shared_tokens: int = 0
    num_committed_blocks: int = 0
    reads_prefix_cache: bool = True
    lora_id: int = 0


def tokens(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def run(manager: BlockManager, token_ids: list[int]) -> FakeSeq:
    """Admit a sequence and commit every one of its tokens, as if one step computed them all."""
    seq = FakeSeq(list(token_ids))
    manager.allocate(seq)
    manager.commit(seq, len(token_ids))
    return seq


def in_trie(manager: BlockManager, blocks: list[int]) -> list[bool]:
    assert manager.trie is not None
    return [b in manager.trie for b in blocks]


def take_one_block(manager: BlockManager, held: list[FakeSeq]) -> int:
    """Admit a one-token sequence of fresh tokens; return the block it got."""
    seq = FakeSeq([10_000 + len(held)])
    manager.allocate(seq)
    held.append(seq)
    manager.check_integrity(held)
    return seq.block_table[0]


# --- prefix cache off ---------------------------------------------------------------------


@pytest.mark.parametrize(("num_tokens", "expected_blocks"), [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_allocate_gives_ceil_len_over_block_size_distinct_blocks(num_tokens: int, expected_blocks: int) -> None:
    manager = BlockManager(8, BS, prefix_cache=False)
    seq = FakeSeq(tokens(0, num_tokens))
    manager.allocate(seq)
    assert len(seq.block_table) == expected_blocks
    assert len(set(seq.block_table)) == expected_blocks
    assert all(0 <= b < 8 for b in seq.block_table)
    assert manager.num_used_blocks == expected_blocks
    assert manager.num_free_blocks == 8 - expected_blocks
    assert seq.num_shared_tokens == 0
    manager.check_integrity([seq])


def test_two_sequences_get_disjoint_blocks() -> None:
    manager = BlockManager(8, BS, prefix_cache=False)
    a, b = FakeSeq(tokens(0, 6)), FakeSeq(tokens(0, 6))  # equal tokens, but no cache: no sharing
    manager.allocate(a)
    manager.allocate(b)
    assert not set(a.block_table) & set(b.block_table)
    manager.check_integrity([a, b])


def test_append_slot_adds_a_block_only_at_a_block_boundary() -> None:
    manager = BlockManager(8, BS, prefix_cache=False)
    seq = FakeSeq(tokens(0, 3))
    manager.allocate(seq)
    # 4 tokens fit in one block; the 5th and the 9th open a new block.
    for n, expected in [(4, 1), (5, 2), (6, 2), (7, 2), (8, 2), (9, 3), (10, 3)]:
        before = list(seq.block_table)
        seq.token_ids.append(100 + n)
        assert len(seq.token_ids) == n
        manager.append_slot(seq)
        assert len(seq.block_table) == expected
        assert seq.block_table[: len(before)] == before  # existing blocks never move
        manager.check_integrity([seq])
    assert manager.num_used_blocks == 3


def test_allocate_exhaustion_raises_and_takes_no_block() -> None:
    manager = BlockManager(4, BS, prefix_cache=False)
    first = FakeSeq(tokens(0, 9))  # 3 blocks
    manager.allocate(first)
    too_big = FakeSeq(tokens(0, 5))  # 2 blocks, only 1 free
    assert not manager.can_allocate(too_big)
    with pytest.raises(KVCacheExhausted):
        manager.allocate(too_big)
    assert too_big.block_table == []
    assert manager.num_free_blocks == 1 and manager.num_used_blocks == 3
    manager.check_integrity([first])
    fits = FakeSeq(tokens(0, 4))  # 1 block: the pool was left intact
    assert manager.can_allocate(fits)
    manager.allocate(fits)
    manager.check_integrity([first, fits])


def test_can_allocate_honours_the_reserve() -> None:
    manager = BlockManager(4, BS, prefix_cache=False)
    seq = FakeSeq(tokens(0, 8))  # 2 blocks of 4 free
    assert manager.can_allocate(seq, reserve=2)
    assert not manager.can_allocate(seq, reserve=3)


def test_append_slot_exhaustion_raises_and_leaves_the_table() -> None:
    manager = BlockManager(2, BS, prefix_cache=False)
    seq = FakeSeq(tokens(0, 8))
    manager.allocate(seq)
    seq.token_ids.append(8)
    with pytest.raises(KVCacheExhausted):
        manager.append_slot(seq)
    assert len(seq.block_table) == 2
    assert manager.num_free_blocks == 0
    manager.check_integrity([seq])


def test_free_returns_blocks_and_they_are_reused() -> None:
    manager = BlockManager(3, BS, prefix_cache=False)
    a = FakeSeq(tokens(0, 12))  # the whole pool
    manager.allocate(a)
    held = set(a.block_table)
    assert held == {0, 1, 2} and manager.num_free_blocks == 0
    manager.free(a)
    assert a.block_table == [] and manager.num_free_blocks == 3 and manager.num_used_blocks == 0
    manager.check_integrity([])
    b = FakeSeq(tokens(50, 12))
    manager.allocate(b)
    assert set(b.block_table) == held
    manager.check_integrity([b])


def test_integrity_detects_a_block_shared_without_refcount() -> None:
    manager = BlockManager(4, BS, prefix_cache=False)
    a, b = FakeSeq(tokens(0, 4)), FakeSeq(tokens(0, 4))
    manager.allocate(a)
    manager.allocate(b)
    manager.check_integrity([a, b])
    b.block_table = list(a.block_table)  # a's block now in two tables, refcount still 1
    with pytest.raises(AssertionError):
        manager.check_integrity([a, b])


def test_integrity_detects_a_leaked_block() -> None:
    manager = BlockManager(4, BS, prefix_cache=False)
    a = FakeSeq(tokens(0, 6))
    manager.allocate(a)
    a.block_table = []  # dropped without free: its blocks are referenced by nobody
    with pytest.raises(AssertionError):
        manager.check_integrity([a])


def test_integrity_detects_a_block_twice_in_one_table() -> None:
    manager = BlockManager(4, BS, prefix_cache=False)
    a = FakeSeq(tokens(0, 8))
    manager.allocate(a)
    a.block_table = [a.block_table[0], a.block_table[0]]
    with pytest.raises(AssertionError):
        manager.check_integrity([a])


def test_integrity_detects_a_leaked_cached_block() -> None:
    manager = BlockManager(4, BS)
    a = run(manager, tokens(0, 8))
    manager.check_integrity([a])
    with pytest.raises(AssertionError):
        manager.check_integrity([])  # a forgotten without free


# --- prefix cache on ----------------------------------------------------------------------


def test_a_committed_prefix_is_shared_by_the_next_sequence() -> None:
    manager = BlockManager(8, BS)
    a = run(manager, tokens(0, 10))  # blocks 0..3, 4..7 full; 8, 9 partial
    b = FakeSeq(tokens(0, 8) + [77, 78, 79])  # same two full blocks, then different tokens
    manager.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_shared_tokens == 2 * BS
    assert b.num_committed_blocks == 2
    assert len(b.block_table) == 3 and b.block_table[2] not in a.block_table
    assert manager.ref_counts[a.block_table[0]] == 2 and manager.ref_counts[a.block_table[1]] == 2
    assert manager.ref_counts[a.block_table[2]] == 1 and manager.ref_counts[b.block_table[2]] == 1
    assert manager.num_used_blocks == 4  # 3 for a, 1 new for b
    manager.check_integrity([a, b])


def test_nothing_is_shared_before_commit() -> None:
    manager = BlockManager(8, BS)
    a = FakeSeq(tokens(0, 10))
    manager.allocate(a)  # allocated, but nothing computed yet
    b = FakeSeq(tokens(0, 10))
    manager.allocate(b)
    assert b.num_shared_tokens == 0
    assert not set(a.block_table) & set(b.block_table)
    manager.check_integrity([a, b])


def test_commit_caches_only_computed_full_blocks() -> None:
    manager = BlockManager(8, BS)
    a = FakeSeq(tokens(0, 12))
    manager.allocate(a)
    manager.commit(a, 7)  # one full block computed, the second only partly
    assert a.num_committed_blocks == 1 and manager.num_cached_blocks == 1
    b = FakeSeq(tokens(0, 12))
    manager.allocate(b)
    assert b.num_shared_tokens == BS and b.block_table[0] == a.block_table[0]
    manager.check_integrity([a, b])


def test_prompt_of_exactly_k_full_blocks_matches_only_k_minus_one() -> None:
    manager = BlockManager(8, BS)
    a = run(manager, tokens(0, 3 * BS))
    assert manager.num_cached_blocks == 3
    b = FakeSeq(tokens(0, 3 * BS))
    manager.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]  # the last block is computed again
    assert b.num_shared_tokens == 2 * BS
    assert len(b.block_table) == 3
    # One more token after those 3 blocks and all three match.
    c = FakeSeq(tokens(0, 3 * BS) + [99])
    manager.allocate(c)
    assert c.block_table[:3] == a.block_table and c.num_shared_tokens == 3 * BS
    manager.check_integrity([a, b, c])


def test_partial_last_block_is_never_cached() -> None:
    manager = BlockManager(8, BS)
    a = run(manager, tokens(0, BS + 3))  # one full block, three tokens in the second
    assert manager.num_cached_blocks == 1
    assert a.block_table[1] not in manager.trie
    b = FakeSeq(tokens(0, BS + 3) + [99, 100])  # the same 3 tokens and more
    manager.allocate(b)
    assert b.num_shared_tokens == BS
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    manager.check_integrity([a, b])


def test_different_first_block_shares_nothing() -> None:
    manager = BlockManager(8, BS)
    a = run(manager, tokens(0, 9))
    b = FakeSeq([1000] + tokens(1, 8))  # second block equal, first not: no match
    manager.allocate(b)
    assert b.num_shared_tokens == 0 and not set(a.block_table) & set(b.block_table)
    manager.check_integrity([a, b])


def test_freeing_one_sharer_keeps_the_shared_blocks() -> None:
    manager = BlockManager(8, BS)
    a = run(manager, tokens(0, 9))
    b = run(manager, tokens(0, 9))
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    assert [manager.ref_counts[x] for x in shared] == [2, 2]
    manager.free(a)
    assert [manager.ref_counts[x] for x in shared] == [1, 1]
    assert manager.num_evictable_blocks == 0
    assert manager.num_used_blocks == 3  # b's 3 blocks
    manager.check_integrity([b])
    manager.free(b)
    assert [manager.ref_counts[x] for x in shared] == [0, 0]
    assert manager.num_used_blocks == 0 and manager.num_free_blocks == 8
    assert manager.num_evictable_blocks == 2
    assert all(x in manager.trie for x in shared) and manager.num_cached_blocks == 2
    manager.check_integrity([])


def test_an_evictable_prefix_is_revived_by_the_next_sequence() -> None:
    manager = BlockManager(8, BS)
    a = run(manager, tokens(0, 9))
    cached = a.block_table[:2]
    manager.free(a)
    assert manager.num_evictable_blocks == 2
    b = FakeSeq(tokens(0, 9))
    assert manager.admission_cost(b) == (3, 1)  # 1 new block + 2 revived; 1 token to compute
    manager.allocate(b)
    assert b.block_table[:2] == cached and b.num_shared_tokens == 2 * BS
    assert manager.num_evictable_blocks == 0
    assert manager.evictions == 0
    manager.check_integrity([b])


def test_reviving_cached_blocks_counts_against_the_free_pool() -> None:
    manager = BlockManager(4, BS)
    a = run(manager, tokens(0, 2 * BS + 1))  # 2 cached blocks + 1 partial
    cached = a.block_table[:2]
    manager.free(a)
    other = FakeSeq(tokens(500, 2 * BS))
    manager.allocate(other)  # takes the 2 blocks that hold no cached prefix
    assert not set(other.block_table) & set(cached)
    assert manager.num_free_blocks == 2 and manager.num_evictable_blocks == 2
    # Reusing the 2 cached blocks and adding 1 new one needs 3 blocks out of the free queue; 2 are there.
    b = FakeSeq(tokens(0, 2 * BS) + [1])
    assert manager.admission_cost(b) == (3, 1)
    assert not manager.can_allocate(b)
    with pytest.raises(KVCacheExhausted):
        manager.allocate(b)
    assert b.block_table == [] and b.num_shared_tokens == 0
    assert [manager.ref_counts[x] for x in cached] == [0, 0]
    assert manager.num_free_blocks == 2 and manager.num_evictable_blocks == 2
    assert in_trie(manager, cached) == [True, True] and manager.evictions == 0
    manager.check_integrity([other])


def test_plain_free_blocks_are_used_before_cached_ones_are_evicted() -> None:
    manager = BlockManager(6, BS)
    a = run(manager, tokens(0, 9))  # 2 cached blocks + 1 partial
    cached = a.block_table[:2]
    manager.free(a)
    assert manager.num_evictable_blocks == 2
    b = FakeSeq(tokens(500, 16))  # 4 blocks: exactly the 4 blocks that hold no cached prefix
    manager.allocate(b)
    assert not set(b.block_table) & set(cached)
    assert manager.evictions == 0
    assert all(x in manager.trie for x in cached)
    manager.check_integrity([b])
    c = FakeSeq(tokens(900, 1))  # now only cached blocks are left: one is evicted
    manager.allocate(c)
    assert c.block_table[0] in cached
    assert manager.evictions == 1
    manager.check_integrity([b, c])


def test_deepest_block_is_evicted_before_its_parent() -> None:
    manager = BlockManager(4, BS)
    a = run(manager, tokens(0, 3 * BS))  # three full blocks, all cached on commit
    chain = list(a.block_table)
    manager.free(a)
    assert manager.num_evictable_blocks == 3 and manager.num_cached_blocks == 3
    held: list[FakeSeq] = []

    assert take_one_block(manager, held) not in chain  # the never-used block goes first
    assert in_trie(manager, chain) == [True, True, True] and manager.evictions == 0

    assert take_one_block(manager, held) == chain[2]
    assert in_trie(manager, chain) == [True, True, False] and manager.evictions == 1

    assert take_one_block(manager, held) == chain[1]
    assert in_trie(manager, chain) == [True, False, False] and manager.evictions == 2

    assert take_one_block(manager, held) == chain[0]
    assert in_trie(manager, chain) == [False, False, False] and manager.evictions == 3
    assert manager.num_evictable_blocks == 0 and manager.num_cached_blocks == 0
    with pytest.raises(KVCacheExhausted):
        take_one_block(manager, held)


def test_least_recently_freed_prefix_is_evicted_first() -> None:
    manager = BlockManager(4, BS)
    a = run(manager, tokens(0, 2 * BS))  # commit caches both full blocks
    b = run(manager, tokens(100, 2 * BS))
    a_chain, b_chain = list(a.block_table), list(b.block_table)
    manager.free(a)
    manager.free(b)  # b is the more recently used
    assert manager.num_evictable_blocks == 4
    held: list[FakeSeq] = []
    assert take_one_block(manager, held) == a_chain[1]
    assert take_one_block(manager, held) == a_chain[0]
    assert in_trie(manager, a_chain) == [False, False] and in_trie(manager, b_chain) == [True, True]
    assert take_one_block(manager, held) == b_chain[1]
    assert manager.evictions == 3 and manager.num_evictable_blocks == 1


def test_reusing_a_cached_prefix_makes_it_recent_again() -> None:
    manager = BlockManager(6, BS)
    a = run(manager, tokens(0, 2 * BS))
    b = run(manager, tokens(100, 2 * BS))
    a_chain, b_chain = list(a.block_table), list(b.block_table)
    manager.free(a)
    manager.free(b)
    again = run(manager, tokens(0, 2 * BS) + [7])  # hits a's two blocks, takes one plain block
    assert again.block_table[:2] == a_chain and again.num_shared_tokens == 2 * BS
    manager.free(again)  # a's prefix is now newer than b's
    assert manager.num_evictable_blocks == 4
    held: list[FakeSeq] = []
    plain = {take_one_block(manager, held), take_one_block(manager, held)}
    assert not plain & set(a_chain + b_chain) and manager.evictions == 0
    assert take_one_block(manager, held) == b_chain[1]
    assert take_one_block(manager, held) == b_chain[0]
    assert in_trie(manager, a_chain) == [True, True]
    assert manager.evictions == 2


# --- blocks side by side ------------------------------------------------------------------


def grow(manager: BlockManager, seqs: list[FakeSeq], tokens_each: int) -> None:
    """Every sequence appends `tokens_each` tokens, a token at a time together, as a batch decodes."""
    for _ in range(tokens_each):
        for seq in seqs:
            seq.token_ids.append(0)
            manager.append_slot(seq)
        manager.check_integrity(seqs)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_sequences_admitted_with_room_grow_into_adjacent_blocks(prefix_cache: bool) -> None:
    manager = BlockManager(64, BS, prefix_cache=prefix_cache)
    seqs = [FakeSeq(tokens(100 * i, 6)) for i in range(4)]  # 2 blocks each, growing to 5 (19 tokens)
    for seq in seqs:
        manager.allocate(seq, room=3)
    grow(manager, seqs, 13)
    for seq in seqs:
        assert len(seq.block_table) == 5
        assert seq.block_table == list(range(seq.block_table[0], seq.block_table[0] + 5)), seq.block_table


def test_without_room_growing_sequences_interleave_but_still_take_a_free_neighbour() -> None:
    manager = BlockManager(64, BS, prefix_cache=False)
    first, second = FakeSeq(tokens(0, 4)), FakeSeq(tokens(100, 4))
    manager.allocate(first)
    manager.allocate(second)
    assert (first.block_table, second.block_table) == ([0], [1])
    grow(manager, [second, first], 4)
    assert second.block_table == [1, 2]  # its neighbour was free
    assert first.block_table == [0, 3]  # its neighbour is the second's: the head of the queue instead


def test_spare_blocks_go_to_others_once_no_plain_block_is_left() -> None:
    manager = BlockManager(6, BS, prefix_cache=False)
    roomy = FakeSeq(tokens(0, 4))
    manager.allocate(roomy, room=4)  # block 0, and blocks 1-4 spare for it
    assert manager.num_free_blocks == 5
    other = FakeSeq(tokens(100, 12))
    manager.allocate(other)  # block 5 first, then spare ones
    manager.check_integrity([roomy, other])
    assert other.block_table[0] == 5 and len(other.block_table) == 3
    assert manager.num_free_blocks == 2
    third = FakeSeq(tokens(200, 8))
    manager.allocate(third)  # the last two: the pool is used whole
    manager.check_integrity([roomy, other, third])
    assert manager.num_free_blocks == 0
    with pytest.raises(KVCacheExhausted):
        grow(manager, [roomy], 1)


def test_spare_blocks_are_used_before_a_cached_block_is_evicted() -> None:
    manager = BlockManager(5, BS)
    cached = run(manager, tokens(0, 8))  # two full blocks, cached once freed
    manager.free(cached)
    roomy = FakeSeq(tokens(100, 4))
    manager.allocate(roomy, room=2)  # the next plain block, and the last plain one after it spare
    assert roomy.block_table == [2] and manager.num_free_blocks == 4
    other = FakeSeq(tokens(200, 4))
    manager.allocate(other)
    assert other.block_table == [3]  # spare, not the cached 0 or 1
    assert in_trie(manager, [0, 1]) == [True, True] and manager.evictions == 0
    manager.check_integrity([roomy, other])


def test_a_freed_sequence_gives_its_spare_blocks_back_as_plain_free_ones() -> None:
    manager = BlockManager(8, BS, prefix_cache=False)
    roomy = FakeSeq(tokens(0, 4))
    manager.allocate(roomy, room=3)  # block 0; blocks 1-3 spare
    manager.free(roomy)
    manager.check_integrity([])
    again = FakeSeq(tokens(100, 16))
    manager.allocate(again)  # a fresh run from the head of the queue: its blocks and the ones spare before
    assert again.block_table == [0, 1, 2, 3]
