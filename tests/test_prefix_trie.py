"""PrefixTrie alone: hash-chain matching, forced collisions, orphan inserts, subtree removal."""

import pytest

from kvcache.prefix_trie import PrefixTrie

BS = 3
A, B, C, D = [1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]


def chain(trie: PrefixTrie, blocks: list[list[int]], first_id: int = 0) -> list[int]:
    """Insert `blocks` as one prefix, block i under block i-1, with ids first_id, first_id+1, ..."""
    ids = list(range(first_id, first_id + len(blocks)))
    for i, tokens in enumerate(blocks):
        assert trie.insert(ids[i - 1] if i else None, tokens, ids[i])
    return ids


def test_match_returns_the_longest_cached_run_of_full_blocks() -> None:
    trie = PrefixTrie(BS)
    chain(trie, [A, B, C], first_id=10)
    assert trie.match(A + B + C, max_blocks=3) == [10, 11, 12]
    assert trie.match(A + B + D, max_blocks=3) == [10, 11]
    assert trie.match(A + B + C + [1], max_blocks=9) == [10, 11, 12]
    assert trie.match(A + B + C[:2], max_blocks=3) == [10, 11]  # a partial block never matches
    assert trie.match(D + A, max_blocks=2) == []
    assert len(trie) == 3
    trie.check_integrity()


def test_match_stops_at_max_blocks() -> None:
    trie = PrefixTrie(BS)
    chain(trie, [A, B, C])
    assert trie.match(A + B + C, max_blocks=2) == [0, 1]
    assert trie.match(A + B + C, max_blocks=0) == []


def test_same_block_under_a_different_parent_does_not_match() -> None:
    trie = PrefixTrie(BS)
    chain(trie, [A, B])  # B cached only after A
    assert trie.match(C + B, max_blocks=2) == []
    assert trie.match(B, max_blocks=1) == []  # B is not a first block either
    trie.check_integrity()


def test_same_tokens_under_two_parents_are_two_nodes() -> None:
    trie = PrefixTrie(BS)
    chain(trie, [A, B], first_id=0)
    chain(trie, [C, B], first_id=2)
    assert trie.match(A + B, max_blocks=2) == [0, 1]
    assert trie.match(C + B, max_blocks=2) == [2, 3]
    trie.check_integrity()


def test_first_copy_of_a_prefix_wins() -> None:
    trie = PrefixTrie(BS)
    chain(trie, [A, B])
    assert not trie.insert(None, A, 5)
    assert not trie.insert(0, B, 6)
    assert 5 not in trie and 6 not in trie and len(trie) == 2
    assert trie.match(A + B, max_blocks=2) == [0, 1]
    trie.check_integrity()


def test_insert_under_a_parent_not_in_the_trie_is_refused() -> None:
    trie = PrefixTrie(BS)
    assert not trie.insert(7, A, 8)  # 7 was never cached
    assert 8 not in trie and len(trie) == 0
    chain(trie, [A])
    trie.remove(0)
    assert not trie.insert(0, B, 1)  # 0 was evicted
    assert len(trie) == 0
    trie.check_integrity()


def test_forced_collision_compares_tokens() -> None:
    trie = PrefixTrie(BS, hash_fn=lambda _: 42)  # every key collides
    assert trie.insert(None, A, 0)
    assert trie.match(A, max_blocks=1) == [0]
    assert trie.match(B, max_blocks=1) == []  # same key, other tokens: a miss, not block 0
    assert trie.match(B + A, max_blocks=2) == []
    assert not trie.insert(None, B, 1)  # the key is taken by A
    assert 1 not in trie and len(trie) == 1
    trie.check_integrity()


def test_forced_collision_still_chains_through_different_parents() -> None:
    trie = PrefixTrie(BS, hash_fn=lambda _: 42)
    chain(trie, [A, B, C])  # one child per node, so the shared key never clashes
    assert trie.match(A + B + C, max_blocks=3) == [0, 1, 2]
    assert trie.match(A + C + C, max_blocks=3) == [0]
    trie.check_integrity()


def test_remove_drops_the_whole_subtree_and_returns_its_ids() -> None:
    trie = PrefixTrie(BS)
    chain(trie, [A, B, C], first_id=0)  # 0 -> 1 -> 2
    assert trie.insert(1, D, 3)  # 1 -> 3 as well
    assert trie.insert(0, C, 4)  # 0 -> 4
    chain(trie, [D], first_id=5)  # an unrelated root
    assert sorted(trie.remove(1)) == [1, 2, 3]
    assert len(trie) == 3
    assert [b in trie for b in range(6)] == [True, False, False, False, True, True]
    assert trie.match(A + B + C, max_blocks=3) == [0]
    assert trie.match(A + C, max_blocks=2) == [0, 4]
    trie.check_integrity()
    assert trie.insert(0, B, 6)  # the removed slot can be cached again
    assert trie.match(A + B, max_blocks=2) == [0, 6]
    trie.check_integrity()


def test_remove_a_leaf_returns_only_it() -> None:
    trie = PrefixTrie(BS)
    chain(trie, [A, B])
    assert trie.remove(1) == [1]
    assert 0 in trie and len(trie) == 1
    trie.check_integrity()


def test_check_integrity_catches_an_unreachable_node() -> None:
    trie = PrefixTrie(BS)
    chain(trie, [A, B])
    trie.check_integrity()
    trie.root().children.clear()  # nodes still indexed, but not reachable
    with pytest.raises(AssertionError):
        trie.check_integrity()


def test_insert_rejects_a_partial_block() -> None:
    trie = PrefixTrie(BS)
    with pytest.raises(AssertionError):
        trie.insert(None, A[:2], 0)
