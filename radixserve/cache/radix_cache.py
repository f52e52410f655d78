"""RadixCache: the prefix tree that owns the cached KV slots.

Owns the token-prefix -> slot mapping of every cached token, the lock counts that pin the
prefixes running requests use, and eviction of unlocked leaves (the order: eviction.py; LRU
by default, SLRU, priority-aware, over-quota tenants first). It does not know tensors,
requests, the page allocator (evict returns slots, the caller frees their pages) or the model;
slot ids are plain ints it only checks for page alignment.

Layout: one root per salt (namespace), so two salts never share a node. Each node holds a span
of tokens `key` and their slots `value` as `array('i')` (4 bytes a token); children are keyed by
their first page (the first token when page_size == 1, else a tuple of page_size tokens), so
every key and every match is a whole number of pages. Invariants (check_integrity):
  - lock_ref(node) >= sum of its children's lock_ref (a lock pins its node and all ancestors);
  - last_access(node) <= last_access(parent) (every touch touches the whole path);
  - the evictable leaves are exactly the unlocked non-root nodes without children; each has
    an up-to-date entry in the eviction queue (stale entries are skipped or re-pushed).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from radixserve.cache.eviction import EvictionPolicy, EvictionQueue
from radixserve.cache.radix_types import (
    CacheEvent,
    CacheEventKind,
    ChildKey,
    InsertResult,
    MatchResult,
    TreeNode,
)

__all__ = ["CacheEvent", "CacheEventKind", "InsertResult", "MatchResult", "RadixCache",
           "TreeNode"]

IntSeq: TypeAlias = "Sequence[int] | npt.NDArray[np.integer[Any]]"  # list, array('i'), numpy
_INT = np.intc  # the C int behind array('i')


class RadixCache:
    """Longest-prefix match, insert, lock/unlock and LRU eviction over int token ids.

    Who owns slots[i] after insert (aligned_len = len(token_ids) in whole pages):

        [0, num_already_cached)            the tree had these tokens: the caller frees its
                                           duplicates (not the slots it got from a match)
        [num_already_cached, aligned_len)  the tree, from now on
        [aligned_len, len)                 the caller (a partial page)

    Disabled: match finds nothing, insert takes nothing and reports every whole page as
    already cached, so a caller following the contract frees all of its slots.
    """

    def __init__(
        self, page_size: int = 1, disabled: bool = False,
        on_event: Callable[[CacheEvent], None] | None = None,
        eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU,
        tenant_quota_tokens: int | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.disabled = disabled
        self._on_event = on_event
        self._clock = 0
        self._roots: dict[str, TreeNode] = {}
        self.root = self._new_root("")
        self._evictable_size = 0
        self._protected_size = 0
        # Tenants (salts) holding more evictable tokens than this are evicted from first.
        self.tenant_quota_tokens = tenant_quota_tokens
        self._evictable_by_salt: dict[str, int] = {}
        self._queue = EvictionQueue(EvictionPolicy(eviction_policy))

    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes: all of them can be evicted, leaves first."""
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected_size

    @property
    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    @property
    def evictable_by_salt(self) -> dict[str, int]:
        """Unlocked cached tokens per salt (tenant); salts with none are left out."""
        return {salt: n for salt, n in self._evictable_by_salt.items() if n}

    def match_prefix(self, token_ids: IntSeq, salt: str = "", priority: int | None = None
                     ) -> MatchResult:
        """The longest cached prefix of token_ids in whole pages; touches it for LRU.

        Splits the last node when the match ends inside it, so the result's node covers
        exactly the match. Passing an array('i') skips a conversion. NOTE: the caller
        caps the query (e.g. token_ids[:-1]) when it needs logits for the last token.
        `priority` given: this is a request's admission, a hit for SLRU; the matched path
        records the hit and the request's priority (the inserter's own re-match passes None).
        """
        root = self._roots.get(salt)
        aligned_len = self._aligned(len(token_ids))
        if self.disabled or root is None or aligned_len == 0:
            return MatchResult(self.root, 0, [])
        if self._child_key(token_ids, 0) not in root.children:  # a miss converts nothing
            return MatchResult(root, 0, [])
        query = self._to_array(token_ids, aligned_len)
        node, cached_len = self._walk(root, query, self._tick())
        if priority is not None:
            hit = node
            while hit.parent is not None:
                hit.hits += 1
                hit.priority = priority
                hit = hit.parent
        return MatchResult(node, cached_len, self._path_concat(node, values=True).tolist())

    def peek_prefix_len(self, token_ids: IntSeq, salt: str = "") -> int:
        """Length of the longest cached prefix (whole pages), changing nothing: no split, no
        LRU touch. For ordering a waiting queue; admission then matches once for real."""
        root = self._roots.get(salt)
        aligned_len = self._aligned(len(token_ids))
        if self.disabled or root is None or aligned_len == 0:
            return 0
        if self._child_key(token_ids, 0) not in root.children:
            return 0
        return self._walk(root, self._to_array(token_ids, aligned_len), None)[1]

    def insert(self, token_ids: IntSeq, slots: IntSeq, salt: str = "", priority: int = 0
               ) -> InsertResult:
        """Cache token_ids[:aligned_len] with their slots; see the class docstring for ownership.
        A new leaf records `priority` (the inserting request's)."""
        if len(token_ids) != len(slots):
            raise ValueError(f"{len(token_ids)} token ids but {len(slots)} slots")
        aligned_len = self._aligned(len(token_ids))
        if self.disabled:
            return InsertResult(aligned_len, self.root)
        root = self._roots.get(salt) or self._new_root(salt)
        query = self._to_array(token_ids, aligned_len)
        tick = self._tick()
        node, num_cached = self._walk(root, query, tick)
        if num_cached < aligned_len:
            value = self._to_array(slots[num_cached:aligned_len], aligned_len - num_cached)
            self._assert_whole_pages(value)
            node = self._add_leaf(node, query[num_cached:], value, tick, priority)
        return InsertResult(num_cached, node)

    def lock(self, node: TreeNode) -> None:
        """Pin node and its ancestors against eviction. Locking a root does nothing."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self._count_evictable(node, -len(node.key))
                self._protected_size += len(node.key)
                self._queue.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one lock(node)."""
        while node.parent is not None:
            assert node.lock_ref > 0, f"unlock without a matching lock: {node}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_size -= len(node.key)
                self._count_evictable(node, len(node.key))
                if not node.children:
                    self._queue.add(node)
            node = node.parent

    def evict(self, num_tokens: int) -> list[int]:
        """Remove unlocked leaves in eviction order (eviction.py), tenants over their quota
        first, until >= num_tokens slots are freed or nothing is evictable. Whole leaves only,
        so the last one may overshoot. Returns the freed slots; the caller gives their pages
        back to the allocator."""
        freed: array[int] = array("i")
        while len(freed) < num_tokens:
            node = self._queue.pop(self._over_quota()) or self._queue.pop()
            if node is None:
                break
            self._remove_leaf(node)
            freed.extend(node.value)
        return freed.tolist()

    def _over_quota(self) -> list[str]:
        quota = self.tenant_quota_tokens
        if quota is None:
            return []
        return [salt for salt, n in self._evictable_by_salt.items() if n > quota]

    def reset(self) -> list[int]:
        """Drop everything; returns every slot the tree held. Nothing may be locked."""
        assert self._protected_size == 0, "reset while requests hold locked prefixes"
        slots = self.all_slots()
        self._roots.clear()
        self.root = self._new_root("")
        self._evictable_size = 0
        self._evictable_by_salt.clear()
        self._queue.clear()
        if self._on_event is not None:
            self._on_event(CacheEvent(CacheEventKind.CLEARED, (), 0, ""))
        return slots

    def all_slots(self) -> list[int]:
        out: array[int] = array("i")
        for node in self._iter_nodes():
            out.extend(node.value)
        return out.tolist()

    def check_integrity(self) -> None:
        """Recompute every invariant and counter from the nodes; AssertionError on mismatch."""
        for salt, root in self._roots.items():
            assert root.parent is None and not root.key and root.salt == salt, root
            assert root.lock_ref == 0, "a root was locked"
        evictable = protected = 0
        by_salt: dict[str, int] = {}
        leaves: set[TreeNode] = set()
        values: array[int] = array("i")
        for node in self._iter_nodes():
            n, parent = len(node.key), node.parent
            assert parent is not None and parent.salt == node.salt
            assert n > 0 and n == len(node.value) and n % self.page_size == 0, node
            assert parent.children.get(self._child_key(node.key, 0)) is node, "broken link"
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
        assert (evictable, protected) == (self._evictable_size, self._protected_size)
        assert by_salt == self.evictable_by_salt, (by_salt, self.evictable_by_salt)
        assert leaves == self._queue.leaves, "evictable leaf set is stale"
        assert leaves <= self._queue.queued(), "an evictable leaf is not queued"
        assert len(np.unique(np.frombuffer(values, dtype=_INT))) == len(values), "slot twice"
        self._assert_whole_pages(values)

    # -- internals ---------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _new_root(self, salt: str) -> TreeNode:
        root = TreeNode(array("i"), array("i"), None, 0, salt)
        self._roots[salt] = root
        return root

    def _child_key(self, key: IntSeq, start: int) -> ChildKey:
        if self.page_size == 1:
            return key[start]
        return tuple(key[start:start + self.page_size])

    @staticmethod
    def _to_array(ids: IntSeq, n: int) -> array[int]:
        if isinstance(ids, array) and ids.typecode == "i":
            return ids[:n]
        if isinstance(ids, np.ndarray):
            return array("i", np.ascontiguousarray(ids[:n], dtype=_INT).tobytes())
        # NOTE: struct.pack converts a list of ints about 2x faster than array("i", ids).
        return array("i", struct.pack(f"{n}i", *(ids if n == len(ids) else ids[:n])))

    def _common_len(self, key: array[int], query: array[int], pos: int) -> int:
        """Whole-page length of the common prefix of key and query[pos:].

        A C-level array equality settles the common full-span case; numpy finds the first
        mismatch only when there is one (see bench/radix_tree.py for the measurements)."""
        m = min(len(key), len(query) - pos)
        if (key if m == len(key) else key[:m]) == query[pos:pos + m]:
            return m
        a = np.frombuffer(key, dtype=_INT, count=m)
        b = np.frombuffer(query, dtype=_INT, count=m, offset=pos * query.itemsize)
        first = int(np.argmax(a != b))
        return first - first % self.page_size

    def _walk(self, root: TreeNode, query: array[int], tick: int | None
              ) -> tuple[TreeNode, int]:
        """Descend along query, splitting where it diverges inside a node and touching every
        node passed; returns the deepest matched node and the matched length. With tick None
        (a peek) nothing changes and the node returned may extend past the match."""
        node, pos = root, 0
        while pos < len(query):
            child = node.children.get(self._child_key(query, pos))
            if child is None:
                break
            m = self._common_len(child.key, query, pos)
            assert m > 0, "a child matched by its first page must share that page"
            if tick is None:
                node, pos = child, pos + m
                if m < len(child.key):
                    break
                continue
            if m < len(child.key):
                child = self._split(child, m)  # the rest of child differs or the query ended
            child.last_access = tick
            node, pos = child, pos + m
        return node, pos

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut child after m tokens; the new upper node inherits its locks and age."""
        parent = child.parent
        assert parent is not None
        upper = TreeNode(child.key[:m], child.value[:m], parent, child.last_access, child.salt)
        upper.lock_ref = child.lock_ref
        upper.hits, upper.priority = child.hits, child.priority
        parent.children[self._child_key(child.key, 0)] = upper
        child.key, child.value, child.parent = child.key[m:], child.value[m:], upper
        upper.children[self._child_key(child.key, 0)] = child
        return upper

    def _add_leaf(self, parent: TreeNode, key: array[int], value: array[int], tick: int,
                  priority: int) -> TreeNode:
        leaf = TreeNode(key, value, parent, tick, parent.salt)
        leaf.priority = priority
        self._queue.discard(parent)  # it has a child now
        parent.children[self._child_key(key, 0)] = leaf
        self._count_evictable(leaf, len(key))
        self._queue.add(leaf)
        self._emit(CacheEventKind.STORED, leaf)
        return leaf

    def _remove_leaf(self, leaf: TreeNode) -> None:
        self._emit(CacheEventKind.REMOVED, leaf)
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        del parent.children[self._child_key(leaf.key, 0)]
        self._queue.discard(leaf)
        self._count_evictable(leaf, -len(leaf.key))
        if parent.parent is not None:
            if not parent.children and parent.lock_ref == 0:
                self._queue.add(parent)
        elif not parent.children and parent.salt:
            del self._roots[parent.salt]  # an empty namespace costs nothing to recreate

    def _count_evictable(self, node: TreeNode, delta: int) -> None:
        self._evictable_size += delta
        self._evictable_by_salt[node.salt] = self._evictable_by_salt.get(node.salt, 0) + delta

    def _path_concat(self, node: TreeNode, values: bool) -> array[int]:
        parts: list[array[int]] = []
        while node.parent is not None:
            parts.append(node.value if values else node.key)
            node = node.parent
        out: array[int] = array("i")
        for part in reversed(parts):
            out.extend(part)
        return out

    def _emit(self, kind: CacheEventKind, node: TreeNode) -> None:
        if self._on_event is None:
            return
        path = self._path_concat(node, values=False)
        self._on_event(CacheEvent(kind, tuple(path), len(path) - len(node.key), node.salt))

    def _iter_nodes(self) -> Iterator[TreeNode]:
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _assert_whole_pages(self, slots: array[int]) -> None:
        ps = self.page_size
        if ps == 1:
            return
        grid = np.frombuffer(slots, dtype=_INT).reshape(-1, ps)  # (num_pages, ps)
        assert not (grid[:, 0] % ps).any(), "slots do not start on a page boundary"
        assert (grid - grid[:, :1] == np.arange(ps)).all(), "slots are not whole pages"
