"""The tree's side of the tiers below the pool: offloaded nodes and their block keys.

Offloading an evicted node (it stays in the tree with its tier and block keys; the tiers
themselves are cache/tiers/kv_tiers.py's), dropping offloaded nodes, and forgetting blocks
the tiers no longer hold.

Owns no state: Offloading is a base class of RadixCache, the half of its methods that moves
nodes between the pool and the tiers. Every attribute it uses is declared below and created by
RadixCache.__init__, so the cache stays the one keeper of counts, queue entries and events.
Does not know: payloads, files, requests.

Offloaded node (tier LOCAL or SHARED): no slots, never locked, every descendant offloaded,
`block_keys` the keys of the 16-token blocks that end inside it. A pool node whose children
are all offloaded is an evictable leaf.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import TYPE_CHECKING

from radixserve.cache.eviction import EvictionQueue
from radixserve.cache.radix_types import CacheEventKind, Tier, TierHooks, TreeNode
from radixserve.cache.radix_walk import child_key, iter_nodes, path_concat


class Offloading:
    # Created and owned by RadixCache.__init__ (see radix_cache.py).
    page_size: int
    _roots: dict[str, TreeNode]
    _queue: EvictionQueue
    _tiers: TierHooks | None
    _tier_keys: dict[str, TreeNode]
    _tier_tokens: dict[Tier, int]

    if TYPE_CHECKING:  # defined by RadixCache
        def _remove_leaf(self, leaf: TreeNode) -> None: ...
        def _after_child_left(self, parent: TreeNode) -> None: ...
        def _count_evictable(self, node: TreeNode, delta: int) -> None: ...
        def _emit(self, kind: CacheEventKind, node: TreeNode) -> None: ...

    @property
    def tiered(self) -> bool:
        """Evicted KV goes to tiers below the pool (the tree keeps offloaded nodes)."""
        return self._tiers is not None

    @property
    def tier_tokens(self) -> dict[Tier, int]:
        """Tokens of offloaded nodes (in the tree, KV only in a tier), by tier."""
        return {t: n for t, n in self._tier_tokens.items() if n}

    def tier_keys(self) -> dict[str, Tier]:
        """The block keys of the offloaded nodes, with the tier each node says it is in."""
        return {key: node.tier for key, node in self._tier_keys.items()}

    def prune_tier_keys(self, keys: list[str]) -> int:
        """The tiers no longer hold these blocks (evicted, failed to write): drop the offloaded
        nodes they end in, with their subtrees. Returns the tokens dropped from the tree."""
        before = sum(self._tier_tokens.values())
        for key in keys:
            node = self._tier_keys.get(key)
            if node is not None:
                self._drop_offloaded(node)
        return before - sum(self._tier_tokens.values())

    def pool_paths(self) -> Iterator[tuple[array[int], array[int], int, str]]:
        """(path tokens, path slots, start of the node's own span, salt) of every pool node."""
        for node in iter_nodes(self._roots.values()):
            if node.tier is Tier.POOL:
                path = path_concat(node, values=False)
                yield path, path_concat(node, values=True), len(path) - len(node.key), node.salt

    def _evict_node(self, node: TreeNode) -> None:
        """Offload node (the tiers took its KV, or its offloaded children still need its
        tokens as their path) or remove it. Its pages are the caller's to free.

        No ghosts: a node whose blocks the tiers could not take (Demotion tier None: a write
        dropped) is removed with its offloaded subtree, whose hash chain runs through the lost
        blocks (no load can reach it), as if the tiers had never been tried."""
        demoted = None
        if self._tiers is not None:
            path = path_concat(node, values=False)
            demoted = self._tiers.on_evict(path, path_concat(node, values=True),
                                           len(path) - len(node.key), node.salt)
        if demoted is not None and demoted.tier is None:
            for child in list(node.children.values()):
                self._drop_offloaded(child)
        tier = None if demoted is None or not demoted.block_keys else demoted.tier
        if tier is None and node.children:
            tier = next(iter(node.children.values())).tier
        if tier is None:
            self._remove_leaf(node)
            return
        self._emit(CacheEventKind.REMOVED, node)  # from the pool; the tiers announce theirs
        self._queue.discard(node)
        self._count_evictable(node, -len(node.key))
        node.value, node.tier = array("i"), tier
        node.block_keys = () if demoted is None or demoted.tier is None else demoted.block_keys
        for key in node.block_keys:
            old = self._tier_keys.get(key)
            if old is not None and old is not node:  # a stale copy elsewhere: keep one owner
                self._drop_offloaded(old)
            self._tier_keys[key] = node
        self._tier_tokens[tier] = self._tier_tokens.get(tier, 0) + len(node.key)
        assert node.parent is not None
        self._after_child_left(node.parent)

    def _drop_offloaded(self, node: TreeNode) -> None:
        """Remove an offloaded node and its (offloaded) subtree from the tree; the blocks stay
        in their tiers, found by the hash chain."""
        assert node.tier is not Tier.POOL and node.parent is not None
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            for key in n.block_keys:
                if self._tier_keys.get(key) is n:
                    del self._tier_keys[key]
            self._tier_tokens[n.tier] -= len(n.key)
        parent = node.parent
        del parent.children[child_key(node.key, 0, self.page_size)]
        node.parent = None
        self._after_child_left(parent)
