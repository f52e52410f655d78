"""The per-node half of RadixCache.check_integrity: recount what the nodes hold.

Owns: Census and census(), which assert every node's own invariants and count tokens, locks,
evictable leaves and slots from the nodes alone. Does not know: the counts the cache keeps
(radix_cache.py compares them), eviction queues, events, requests.
"""

from __future__ import annotations

from array import array
from typing import NamedTuple

from radixserve.cache.radix_types import Tier, TreeNode
from radixserve.cache.radix_walk import child_key, has_pool_child, iter_nodes


class Census(NamedTuple):
    """What the nodes under a set of roots hold, recounted from the nodes themselves."""

    evictable: int  # tokens in unlocked pool nodes
    protected: int  # tokens in locked nodes
    evictable_by_salt: dict[str, int]  # unlocked tokens per salt (salts with none left out)
    leaves: set[TreeNode]  # unlocked pool nodes without pool children: the evictable leaves
    values: array[int]  # every slot the nodes hold
    tier_tokens: dict[Tier, int]  # tokens of offloaded nodes, by tier
    tier_keys: dict[str, TreeNode]  # block key -> the offloaded node it ends in


def census(roots: dict[str, TreeNode], page_size: int) -> Census:
    """Assert every root's and node's own invariants (links, whole-page spans, lock counts
    no smaller than the children's, ages no newer than the parent's) and count what the
    nodes hold; check_integrity compares the counts with the cache's. AssertionError on a
    broken node."""
    for salt, root in roots.items():
        assert root.parent is None and not root.key and root.salt == salt, root
        assert root.lock_ref == 0, "a root was locked"
    evictable = protected = 0
    by_salt: dict[str, int] = {}
    leaves: set[TreeNode] = set()
    values: array[int] = array("i")
    tier_tokens: dict[Tier, int] = {}
    tier_keys: dict[str, TreeNode] = {}
    for node in iter_nodes(roots.values()):
        n, parent = len(node.key), node.parent
        assert parent is not None and parent.salt == node.salt
        assert n > 0 and n % page_size == 0, node
        assert parent.children.get(child_key(node.key, 0, page_size)) is node, "broken link"
        if node.tier is not Tier.POOL:  # offloaded: no slots, no locks, offloaded below
            assert not node.value and node.lock_ref == 0, node
            assert all(c.tier is not Tier.POOL for c in node.children.values()), node
            tier_tokens[node.tier] = tier_tokens.get(node.tier, 0) + n
            for key in node.block_keys:
                assert key not in tier_keys, f"block {key} in two offloaded nodes"
                tier_keys[key] = node
            continue
        assert n == len(node.value) and not node.block_keys, node
        assert parent.parent is None or parent.tier is Tier.POOL, "pool node under offloaded"
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), node
        assert parent.parent is None or node.last_access <= parent.last_access, node
        if node.lock_ref:
            protected += n
        else:
            evictable += n
            by_salt[node.salt] = by_salt.get(node.salt, 0) + n
            if not has_pool_child(node):
                leaves.add(node)
        values.extend(node.value)
    return Census(evictable, protected, by_salt, leaves, values, tier_tokens, tier_keys)
