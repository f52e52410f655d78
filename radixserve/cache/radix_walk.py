"""Pure helpers over the radix tree's nodes: page-keyed child lookup, span comparison, the
descent that matches (and splits) a query, path concatenation, node iteration, page checks,
and the per-node half of check_integrity (census).

Owns: no state; every function works on the nodes and the page size it is given. It may
change the tree's shape (split a node, touch last_access on a path) but never a count that
the cache keeps: a split moves tokens between two nodes with the same locks, so sizes,
evictable leaves and events stay as they were. Does not know: locks' accounting, the
eviction queue, sizes per salt, events (radix_cache.py), requests, pages as allocations.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from radixserve.cache.radix_types import ChildKey, TreeNode

IntSeq: TypeAlias = "Sequence[int] | npt.NDArray[np.integer[Any]]"  # list, array('i'), numpy
C_INT = np.intc  # the C int behind array('i')


def child_key(key: IntSeq, start: int, page_size: int) -> ChildKey:
    """The children-dict key of the page of `key` that starts at `start`."""
    if page_size == 1:
        return key[start]
    return tuple(key[start:start + page_size])


def to_array(ids: IntSeq, n: int) -> array[int]:
    """ids[:n] as array('i'); an array('i') is sliced, not converted."""
    if isinstance(ids, array) and ids.typecode == "i":
        return ids[:n]
    if isinstance(ids, np.ndarray):
        return array("i", np.ascontiguousarray(ids[:n], dtype=C_INT).tobytes())
    # NOTE: struct.pack converts a list of ints about 2x faster than array("i", ids).
    return array("i", struct.pack(f"{n}i", *(ids if n == len(ids) else ids[:n])))


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
    """Descend along query, splitting where it diverges inside a node and touching every
    node passed; returns the deepest matched node and the matched length. With tick None
    (a peek) nothing changes and the node returned may extend past the match."""
    node, pos = root, 0
    while pos < len(query):
        child = node.children.get(child_key(query, pos, page_size))
        if child is None:
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


class Census(NamedTuple):
    """What the nodes under a set of roots hold, recounted from the nodes themselves."""

    evictable: int  # tokens in unlocked nodes
    protected: int  # tokens in locked nodes
    evictable_by_salt: dict[str, int]  # unlocked tokens per salt (salts with none left out)
    leaves: set[TreeNode]  # unlocked nodes without children: the evictable leaves
    values: array[int]  # every slot the nodes hold


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
    for node in iter_nodes(roots.values()):
        n, parent = len(node.key), node.parent
        assert parent is not None and parent.salt == node.salt
        assert n > 0 and n == len(node.value) and n % page_size == 0, node
        assert parent.children.get(child_key(node.key, 0, page_size)) is node, "broken link"
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), node
        assert parent.parent is None or node.last_access <= parent.last_access, node
        if node.lock_ref:
            protected += n
        else:
            evictable += n
            by_salt[node.salt] = by_salt.get(node.salt, 0) + n
            if not node.children:
                leaves.add(node)
        values.extend(node.value)
    return Census(evictable, protected, by_salt, leaves, values)


def assert_whole_pages(slots: array[int], page_size: int) -> None:
    ps = page_size
    if ps == 1:
        return
    grid = np.frombuffer(slots, dtype=C_INT).reshape(-1, ps)  # (num_pages, ps)
    assert not (grid[:, 0] % ps).any(), "slots do not start on a page boundary"
    assert (grid - grid[:, :1] == np.arange(ps)).all(), "slots are not whole pages"
