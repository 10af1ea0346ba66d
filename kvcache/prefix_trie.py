"""Prefix block trie: one node per full, computed KV block, children keyed by a hash chain.

A node's key is hash((parent key, block tokens)), so equal keys mean equal prefixes up
to hash collisions; a hit is confirmed by comparing the tokens, so a collision can only
cost a cache miss, never hand out the wrong KV. The trie decides nothing about block
lifetime: the block pool owns that and tells the trie when it reuses a block.

Each namespace (a LoRA adapter's id; 0 the base model) has a root of its own: the same tokens
through two adapters give different keys and values, so their blocks are never shared.
"""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class TrieNode:
    block_id: int
    key: int
    tokens: tuple[int, ...]
    parent: "TrieNode | None"
    children: dict[int, "TrieNode"] = field(default_factory=dict)


class PrefixTrie:
    def __init__(self, block_size: int, hash_fn: Callable[[tuple], int] = hash):
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.roots: dict[int, TrieNode] = {}  # namespace -> its root, made on first use
        self._nodes: dict[int, TrieNode] = {}  # block id -> node

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def _child(self, parent: TrieNode, tokens: tuple[int, ...]) -> TrieNode | None:
        node = parent.children.get(self.hash_fn((parent.key, tokens)))
        if node is not None and node.tokens != tokens:
            log.warning("prefix cache: hash collision detected; treated as a miss")
            return None
        return node

    def root(self, namespace: int = 0) -> TrieNode:
        if namespace not in self.roots:
            self.roots[namespace] = TrieNode(block_id=-1, key=namespace, tokens=(), parent=None)
        return self.roots[namespace]

    def match(self, token_ids: Sequence[int], max_blocks: int, namespace: int = 0) -> list[int]:
        """Block ids of the longest cached run of full blocks that starts `token_ids` in `namespace`."""
        blocks, node, bs = [], self.root(namespace), self.block_size
        for i in range(min(max_blocks, len(token_ids) // bs)):
            node = self._child(node, tuple(token_ids[i * bs : (i + 1) * bs]))
            if node is None:
                break
            blocks.append(node.block_id)
        return blocks

    def insert(self, parent_block: int | None, tokens: Sequence[int], block_id: int, namespace: int = 0) -> bool:
        """Cache `block_id` (holding `tokens`) under the block before it (a first block: under the
        namespace's root); False if not cached.

        Not cached when the parent is not in the trie (evicted, or itself a duplicate)
        or an equal block is already there: the first copy of a prefix wins.
        """
        assert len(tokens) == self.block_size, "only full blocks are cached"
        assert block_id not in self._nodes
        parent = self.root(namespace) if parent_block is None else self._nodes.get(parent_block)
        tokens = tuple(tokens)
        key = self.hash_fn((parent.key, tokens)) if parent is not None else None
        if parent is None or key in parent.children:
            return False
        node = TrieNode(block_id=block_id, key=key, tokens=tokens, parent=parent)
        parent.children[key] = node
        self._nodes[block_id] = node
        return True

    def remove(self, block_id: int) -> list[int]:
        """Forget a block and its descendants (unreachable without it); returns their ids."""
        node = self._nodes[block_id]
        del node.parent.children[node.key]
        removed, stack = [], [node]
        while stack:
            node = stack.pop()
            del self._nodes[node.block_id]
            removed.append(node.block_id)
            stack.extend(node.children.values())
        return removed

    def check_integrity(self) -> None:
        seen, stack = 0, [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            seen += 1
            assert self._nodes.get(node.block_id) is node, f"block {node.block_id} indexed wrongly"
            assert node.parent.children.get(node.key) is node, f"block {node.block_id} detached"
            assert len(node.tokens) == self.block_size
            stack.extend(node.children.values())
        assert seen == len(self._nodes), "trie index holds unreachable nodes"
