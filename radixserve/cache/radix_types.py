"""Value types of the radix cache: tree nodes, match/insert results and cache events.

Owns: their fields and meaning. Does not know: how the tree is searched or evicted
(radix_cache.py, radix_walk.py).
"""

from __future__ import annotations

from array import array
from enum import Enum
from typing import NamedTuple, TypeAlias

ChildKey: TypeAlias = "int | tuple[int, ...]"


class CacheEventKind(str, Enum):
    """Equal to the plain strings "stored", "removed", "cleared"."""

    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


class CacheEvent(NamedTuple):
    """One change of the cached token set, for a subscriber such as the router.

    token_ids is the full path from the root to the end of the affected node; tokens
    [prefix_len:] are the ones stored or removed. CLEARED (reset) clears every salt and
    carries no tokens. Node splits are not events: the cached set does not change.
    """

    kind: CacheEventKind
    token_ids: tuple[int, ...]
    prefix_len: int
    salt: str


class TreeNode:
    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access", "salt",
                 "hits", "priority")

    def __init__(
        self, key: array[int], value: array[int], parent: TreeNode | None, last_access: int,
        salt: str,
    ) -> None:
        self.key = key  # token ids of this span
        self.value = value  # their slots, same length
        self.parent = parent  # None only for a salt's root
        self.children: dict[ChildKey, TreeNode] = {}
        self.lock_ref = 0  # locks held on this node or any descendant
        self.last_access = last_access  # the cache's operation counter, not wall time
        self.salt = salt
        self.hits = 0  # admissions that matched this node after its insert (SLRU's promotion)
        self.priority = 0  # of the last request that matched it (lower = more important)

    def __repr__(self) -> str:
        return (f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, "
                f"last_access={self.last_access}, children={len(self.children)})")


class MatchResult(NamedTuple):
    node: TreeNode  # deepest matched node: lock it while using `slots`
    cached_len: int  # a multiple of page_size
    slots: list[int]  # slots of token_ids[:cached_len]


class InsertResult(NamedTuple):
    num_already_cached: int  # leading tokens the tree already had before this insert
    node: TreeNode  # the node of the last inserted token
