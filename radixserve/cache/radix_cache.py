"""RadixCache: the prefix tree that owns the cached KV slots.

Owns the token-prefix -> slot mapping of every cached token, the lock counts that pin the
prefixes running requests use, and eviction of unlocked leaves (the order: eviction.py; LRU
by default, SLRU, priority-aware, over-quota tenants first). It does not know tensors,
requests, the page allocator (evict returns slots, the caller frees their pages) or the model;
slot ids are plain ints it only checks for page alignment (page_allocator.whole_pages). The
pure node helpers (child keys, span comparison, the matching descent and its splits) are in
radix_walk.py, the per-node integrity census in radix_census.py; this class keeps every
count, lock, queue entry and event. With tiers (cache/tiers/kv_tiers.py) an evicted node can stay in
the tree offloaded (radix_offload.py): its KV then lives in a tier, not the pool.

Layout: one root per salt (namespace), so two salts never share a node. Each node holds a span
of tokens `key` and their slots `value` as `array('i')` (4 bytes a token); children are keyed by
their first page (the first token when page_size == 1, else a tuple of page_size tokens), so
every key and every match is a whole number of pages. Invariants (check_integrity):
  - lock_ref(node) >= sum of its children's lock_ref (a lock pins its node and all ancestors);
  - last_access(node) <= last_access(parent) (every touch touches the whole path);
  - the evictable leaves are exactly the unlocked non-root pool nodes without pool children;
    each has an up-to-date entry in the eviction queue (stale entries are skipped or re-pushed);
  - offloaded nodes hold no slots and no locks, only offloaded nodes below them, and their
    block keys and token counts match the cache's tier index.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator

import numpy as np

from radixserve.cache.eviction import EvictionPolicy, EvictionQueue
from radixserve.cache.page_allocator import whole_pages
from radixserve.cache.radix_census import census
from radixserve.cache.radix_offload import Offloading
from radixserve.cache.radix_types import (
    C_INT,
    CacheEvent,
    CacheEventKind,
    InsertResult,
    IntSeq,
    MatchResult,
    Tier,
    TierHooks,
    TreeNode,
    to_array,
)
from radixserve.cache.radix_walk import child_key, has_pool_child, iter_nodes, path_concat, walk

__all__ = ["CacheEvent", "CacheEventKind", "InsertResult", "MatchResult", "RadixCache",
           "TreeNode"]


class RadixCache(Offloading):
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
        on_event: Callable[[CacheEvent], object] | None = None,  # its result is ignored
        eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU,
        tenant_quota_tokens: int | None = None,
        tiers: TierHooks | None = None, pool_medium: str | None = None,
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
        # Tiers below the pool (None: eviction drops). An evicted node the tiers took stays
        # in the tree, offloaded; these index its blocks and count its tokens.
        self._tiers = tiers
        self._pool_medium = pool_medium
        self._tier_keys: dict[str, TreeNode] = {}
        self._tier_tokens: dict[Tier, int] = {}

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

    def root_for(self, salt: str) -> TreeNode | None:
        """The root of a namespace, for read-only walks (speculative drafts); None: empty."""
        return None if self.disabled else self._roots.get(salt)

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
        if child_key(token_ids, 0, self.page_size) not in root.children:  # a miss: no conversion
            return MatchResult(root, 0, [])
        query = to_array(token_ids, aligned_len)
        node, cached_len = walk(root, query, self._tick(), self.page_size)
        if priority is not None:
            hit = node
            while hit.parent is not None:
                hit.hits += 1
                hit.priority = priority
                hit = hit.parent
        return MatchResult(node, cached_len, path_concat(node, values=True).tolist())

    def peek_prefix_len(self, token_ids: IntSeq, salt: str = "") -> int:
        """Length of the longest cached prefix (whole pages), changing nothing: no split, no
        LRU touch. For ordering a waiting queue; admission then matches once for real."""
        root = self._roots.get(salt)
        aligned_len = self._aligned(len(token_ids))
        if self.disabled or root is None or aligned_len == 0:
            return 0
        if child_key(token_ids, 0, self.page_size) not in root.children:
            return 0
        return walk(root, to_array(token_ids, aligned_len), None, self.page_size)[1]

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
        query = to_array(token_ids, aligned_len)
        tick = self._tick()
        node, num_cached = walk(root, query, tick, self.page_size)
        if num_cached < aligned_len:
            stale = node.children.get(child_key(query, num_cached, self.page_size))
            if stale is not None:  # offloaded: the pool copy being inserted replaces it
                self._drop_offloaded(stale)
                self._roots[salt] = root  # dropping the namespace's last child removed it
            value = to_array(slots[num_cached:aligned_len], aligned_len - num_cached)
            self._assert_whole_pages(value)
            node = self._add_leaf(node, query[num_cached:], value, tick, priority)
            if self._tiers is not None:
                self._tiers.on_insert(query, path_concat(node, values=True), num_cached, salt)
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
                if not has_pool_child(node):
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
            freed.extend(node.value)
            self._evict_node(node)
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
        self._tier_keys.clear()
        self._tier_tokens.clear()
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
        tree = census(self._roots, self.page_size)
        assert (tree.evictable, tree.protected) == (self._evictable_size, self._protected_size)
        by_salt = tree.evictable_by_salt
        assert by_salt == self.evictable_by_salt, (by_salt, self.evictable_by_salt)
        assert tree.leaves == self._queue.leaves, "evictable leaf set is stale"
        assert tree.leaves <= self._queue.queued(), "an evictable leaf is not queued"
        assert tree.tier_tokens == self.tier_tokens, (tree.tier_tokens, self.tier_tokens)
        assert tree.tier_keys == self._tier_keys, "the tier block index is stale"
        values = tree.values
        assert len(np.unique(np.frombuffer(values, dtype=C_INT))) == len(values), "slot twice"
        self._assert_whole_pages(values)

    # -- internals ---------------------------------------------------------------------

    def _assert_whole_pages(self, slots: array[int]) -> None:
        if self.page_size > 1:
            whole_pages(np.frombuffer(slots, dtype=C_INT), self.page_size)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _new_root(self, salt: str) -> TreeNode:
        root = TreeNode(array("i"), array("i"), None, 0, salt)
        self._roots[salt] = root
        return root

    def _add_leaf(self, parent: TreeNode, key: array[int], value: array[int], tick: int,
                  priority: int) -> TreeNode:
        leaf = TreeNode(key, value, parent, tick, parent.salt)
        leaf.priority = priority
        self._queue.discard(parent)  # it has a child now
        parent.children[child_key(key, 0, self.page_size)] = leaf
        self._count_evictable(leaf, len(key))
        self._queue.add(leaf)
        self._emit(CacheEventKind.STORED, leaf)
        return leaf

    def _remove_leaf(self, leaf: TreeNode) -> None:
        self._emit(CacheEventKind.REMOVED, leaf)
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        del parent.children[child_key(leaf.key, 0, self.page_size)]
        self._queue.discard(leaf)
        self._count_evictable(leaf, -len(leaf.key))
        self._after_child_left(parent)

    def _after_child_left(self, parent: TreeNode) -> None:
        """A child of parent was removed or offloaded: parent may now be an evictable leaf."""
        if parent.parent is not None:
            if parent.tier is Tier.POOL and parent.lock_ref == 0 and not has_pool_child(parent):
                self._queue.add(parent)
        elif not parent.children and parent.salt:
            del self._roots[parent.salt]  # an empty namespace costs nothing to recreate

    def _count_evictable(self, node: TreeNode, delta: int) -> None:
        self._evictable_size += delta
        self._evictable_by_salt[node.salt] = self._evictable_by_salt.get(node.salt, 0) + delta

    def _emit(self, kind: CacheEventKind, node: TreeNode) -> None:
        if self._on_event is None:
            return
        path = path_concat(node, values=False)
        self._on_event(CacheEvent(kind, tuple(path), len(path) - len(node.key), node.salt,
                                  self._pool_medium))

    def _iter_nodes(self) -> Iterator[TreeNode]:
        return iter_nodes(self._roots.values())
