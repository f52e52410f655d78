"""Pure helpers over the radix tree's nodes: lookup, comparison, descent, iteration.

Page-keyed child lookup, span comparison, the descent that matches (and splits) a query,
path concatenation and node iteration.

Owns: no state; every function works on the nodes and the page size it is given. It may
change the tree's shape (split a node, touch last_access on a path) but never a count that
the cache keeps: a split moves tokens between two nodes with the same locks, so sizes,
evictable leaves and events stay as they were. Does not know: locks' accounting, the
eviction queue, sizes per salt, events (radix_cache.py), requests, pages as allocations.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator

import numpy as np

from radixserve.cache.radix_types import C_INT, ChildKey, IntSeq, Tier, TreeNode


def child_key(key: IntSeq, start: int, page_size: int) -> ChildKey:
    """The children-dict key of the page of `key` that starts at `start`."""
    if page_size == 1:
        return key[start]
    return tuple(key[start:start + page_size])


def common_len(key: array[int], query: array[int], pos: int, page_size: int) -> int:
    """Whole-page length of the common prefix of key and query[pos:].

    A C-level array equality settles the common full-span case; numpy finds the first
    mismatch only when there is one (see bench/radix_tree.py for the measurements)."""
    m = min(len(key), len(query) - pos)
    if (key if m == len(key) else key[:m]) == query[pos:pos + m]:
        return m
    a = np.frombuffer(key, dtype=C_INT, count=m)
    b = np.frombuffer(query, dtype=C_INT, count=m, offset=pos * query.itemsize)
    first = int(np.argmax(a != b))
    return first - first % page_size


def walk(root: TreeNode, query: array[int], tick: int | None, page_size: int
         ) -> tuple[TreeNode, int]:
    """Descend along query through pool nodes, splitting where it diverges inside a node and
    touching every node passed; returns the deepest matched node and the matched length. It
    stops before an offloaded node (its KV is not in the pool). With tick None (a peek)
    nothing changes and the node returned may extend past the match."""
    node, pos = root, 0
    while pos < len(query):
        child = node.children.get(child_key(query, pos, page_size))
        if child is None or child.tier is not Tier.POOL:
            break
        m = common_len(child.key, query, pos, page_size)
        assert m > 0, "a child matched by its first page must share that page"
        if tick is None:
            node, pos = child, pos + m
            if m < len(child.key):
                break
            continue
        if m < len(child.key):
            child = split(child, m, page_size)  # the rest of child differs or the query ended
        child.last_access = tick
        node, pos = child, pos + m
    return node, pos


def split(child: TreeNode, m: int, page_size: int) -> TreeNode:
    """Cut child after m tokens; the new upper node inherits its locks and age."""
    parent = child.parent
    assert parent is not None
    assert child.tier is Tier.POOL, "offloaded nodes are never split"
    upper = TreeNode(child.key[:m], child.value[:m], parent, child.last_access, child.salt)
    upper.lock_ref = child.lock_ref
    upper.hits, upper.priority = child.hits, child.priority
    parent.children[child_key(child.key, 0, page_size)] = upper
    child.key, child.value, child.parent = child.key[m:], child.value[m:], upper
    upper.children[child_key(child.key, 0, page_size)] = child
    return upper


def path_concat(node: TreeNode, values: bool) -> array[int]:
    """The slots (values=True) or token ids of the path from the root down to node."""
    parts: list[array[int]] = []
    while node.parent is not None:
        parts.append(node.value if values else node.key)
        node = node.parent
    out: array[int] = array("i")
    for part in reversed(parts):
        out.extend(part)
    return out


def iter_nodes(roots: Iterable[TreeNode]) -> Iterator[TreeNode]:
    """Every non-root node under roots (depth first, no order promised)."""
    stack = [child for root in roots for child in root.children.values()]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def has_pool_child(node: TreeNode) -> bool:
    return any(c.tier is Tier.POOL for c in node.children.values())
