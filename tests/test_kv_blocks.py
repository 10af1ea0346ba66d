"""The block manager and the prefix trie, alone: allocation, sharing, eviction order, integrity."""

from dataclasses import dataclass, field

import pytest

from kvcache.block_manager import BlockManager, KVCacheExhausted
from kvcache.prefix_trie import PrefixTrie

BS = 4


@dataclass
class Seq:  # the SequenceBlocks protocol, nothing else
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_committed_blocks: int = 0


def admitted(manager: BlockManager, tokens: list[int]) -> Seq:
    seq = Seq(list(tokens))
    manager.allocate(seq)
    manager.commit(seq, len(tokens))  # as if the step computed every token
    return seq


def test_allocate_gives_enough_distinct_blocks():
    manager = BlockManager(10, BS, prefix_cache=False)
    seq = Seq(list(range(9)))  # 9 tokens: 3 blocks of 4
    manager.allocate(seq)
    assert len(seq.block_table) == len(set(seq.block_table)) == 3
    assert manager.num_used_blocks == 3 and manager.num_free_blocks == 7
    manager.check_integrity([seq])


def test_append_slot_takes_a_block_only_at_a_boundary():
    manager = BlockManager(10, BS, prefix_cache=False)
    seq = Seq(list(range(4)))
    manager.allocate(seq)
    assert len(seq.block_table) == 1
    for n, expected_blocks in [(5, 2), (6, 2), (8, 2), (9, 3)]:
        seq.token_ids = list(range(n))
        manager.append_slot(seq)
        assert len(seq.block_table) == expected_blocks
    manager.check_integrity([seq])


def test_exhaustion_raises_and_takes_nothing():
    manager = BlockManager(4, BS, prefix_cache=False)
    first = Seq(list(range(12)))  # 3 of 4 blocks
    manager.allocate(first)
    second = Seq(list(range(8)))  # needs 2, 1 left
    assert not manager.can_allocate(second)
    with pytest.raises(KVCacheExhausted):
        manager.allocate(second)
    assert second.block_table == [] and manager.num_free_blocks == 1
    manager.check_integrity([first])


def test_decode_exhaustion_raises():
    manager = BlockManager(2, BS, prefix_cache=False)
    seq = Seq(list(range(8)))
    manager.allocate(seq)
    seq.token_ids.append(8)
    with pytest.raises(KVCacheExhausted):
        manager.append_slot(seq)
    manager.check_integrity([seq])


def test_freed_blocks_are_reused():
    manager = BlockManager(3, BS, prefix_cache=False)
    a = Seq(list(range(12)))
    manager.allocate(a)
    blocks = set(a.block_table)
    manager.free(a)
    assert manager.num_free_blocks == 3 and a.block_table == []
    b = Seq(list(range(12)))
    manager.allocate(b)
    assert set(b.block_table) == blocks
    manager.check_integrity([b])


def test_integrity_check_catches_corruption():
    manager = BlockManager(6, BS, prefix_cache=False)
    a = Seq(list(range(8)))
    manager.allocate(a)
    intruder = Seq([0], block_table=[a.block_table[0]])  # holds a block without a reference
    with pytest.raises(AssertionError):
        manager.check_integrity([a, intruder])
    with pytest.raises(AssertionError):
        manager.check_integrity([])  # a's blocks are leaked: referenced by no live sequence


def test_shared_prefix_blocks_are_reused_with_refcounts():
    manager = BlockManager(20, BS)
    prefix = list(range(100, 108))  # two full blocks
    a = admitted(manager, prefix + [1, 2, 3])
    b = admitted(manager, prefix + [7, 8])
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 2 * BS
    assert [manager.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    assert b.block_table[2] != a.block_table[2]
    manager.free(a)
    assert [manager.ref_counts[x] for x in b.block_table[:2]] == [1, 1]
    manager.check_integrity([b])
    manager.free(b)
    assert manager.num_used_blocks == 0 and manager.num_evictable_blocks == 2
    manager.check_integrity([])


def test_a_fully_cached_prompt_leaves_its_last_block_to_compute():
    manager = BlockManager(20, BS)
    prompt = list(range(3 * BS))
    manager.free(admitted(manager, prompt))
    again = admitted(manager, prompt)
    assert again.num_cached_tokens == 2 * BS


def test_only_full_blocks_are_cached():
    manager = BlockManager(20, BS)
    manager.free(admitted(manager, list(range(6))))  # one full block, one partial
    assert manager.num_cached_blocks == 1
    again = Seq(list(range(6)) + [99])
    manager.allocate(again)
    assert again.num_cached_tokens == BS


def test_plain_free_blocks_go_before_cached_ones_and_lru_evicts_deepest_first():
    manager = BlockManager(6, BS)
    a = admitted(manager, list(range(0, 12)))  # blocks a0 a1 a2, cached
    manager.free(a)
    assert manager.num_evictable_blocks == 3
    plain = Seq(list(range(50, 62)))  # 3 blocks: the 3 never-used blocks, no eviction
    manager.allocate(plain)
    assert manager.evictions == 0 and manager.num_cached_blocks == 3
    one_more = Seq(list(range(70, 74)))
    manager.allocate(one_more)  # must evict: the deepest block of a's prefix goes first
    assert manager.evictions == 1 and manager.num_cached_blocks == 2
    rematch = Seq(list(range(0, 12)) + [5])
    assert manager.admission_cost(rematch)[1] == 13 - 2 * BS  # a0 and a1 still cached
    manager.check_integrity([plain, one_more])


def test_least_recently_used_prefix_is_evicted_first():
    manager = BlockManager(4, BS)
    old = list(range(0, 4))
    new = list(range(10, 14))
    manager.free(admitted(manager, old))
    manager.free(admitted(manager, new))
    manager.allocate(Seq(list(range(20, 28))))  # 2 plain blocks, no eviction yet
    assert manager.evictions == 0
    manager.allocate(Seq(list(range(30, 34))))  # evicts the older prefix
    assert manager.admission_cost(Seq(new + [1]))[1] == 1  # the newer one is still cached
    assert manager.admission_cost(Seq(old + [1]))[1] == 5


def test_trie_match_follows_the_hash_chain():
    trie = PrefixTrie(2)
    assert trie.insert(None, [1, 2], block_id=10)
    assert trie.insert(10, [3, 4], block_id=11)
    assert trie.match([1, 2, 3, 4, 5], max_blocks=5) == [10, 11]
    assert trie.match([9, 9, 3, 4], max_blocks=5) == []  # [3, 4] under another parent is another block
    assert trie.match([1, 2, 3, 4], max_blocks=1) == [10]
    trie.check_integrity()


def test_trie_collision_is_a_miss_never_a_wrong_block():
    trie = PrefixTrie(2, hash_fn=lambda _: 42)  # every key collides
    assert trie.insert(None, [1, 2], block_id=10)
    assert trie.match([5, 6], max_blocks=1) == []  # same hash, other tokens
    assert not trie.insert(None, [5, 6], block_id=11)  # the slot is taken: not cached
    assert trie.match([1, 2], max_blocks=1) == [10]


def test_trie_refuses_orphans_and_removes_subtrees():
    trie = PrefixTrie(2)
    assert not trie.insert(7, [1, 2], block_id=10)  # parent 7 is not cached
    trie.insert(None, [1, 2], block_id=1)
    trie.insert(1, [3, 4], block_id=2)
    trie.insert(2, [5, 6], block_id=3)
    trie.insert(1, [7, 8], block_id=4)
    assert sorted(trie.remove(2)) == [2, 3]
    assert 1 in trie and 4 in trie and 2 not in trie and 3 not in trie
    trie.check_integrity()
