"""Value types of the radix cache: nodes, token sequences, results, events, the Tier enum.

Token sequences as nodes hold them, tree nodes, match/insert results and cache events.

Owns: their fields and meaning, and the conversion of token ids or slots into a node's
array('i') (to_array). Does not know: how the tree is searched or evicted (radix_cache.py,
radix_walk.py).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from enum import Enum
from typing import Any, NamedTuple, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

ChildKey: TypeAlias = "int | tuple[int, ...]"
IntSeq: TypeAlias = "Sequence[int] | npt.NDArray[np.integer[Any]]"  # list, array('i'), numpy
C_INT = np.intc  # the C int behind array('i')


class Tier(Enum):
    """Where a block's KV lives. A tree node is in the POOL, LOCAL or SHARED; HOST (host
    memory above the local disk, on CUDA) is a place a LOCAL block is read from, with its own
    load rate and choice counters, never a node's tier."""

    POOL = "pool"
    HOST = "host"
    LOCAL = "local"
    SHARED = "shared"


def to_array(ids: IntSeq, n: int) -> array[int]:
    """ids[:n] as array('i'); an array('i') is sliced, not converted."""
    if isinstance(ids, array) and ids.typecode == "i":
        return ids[:n]
    if isinstance(ids, np.ndarray):
        return array("i", np.ascontiguousarray(ids[:n], dtype=C_INT).tobytes())
    # NOTE: struct.pack converts a list of ints faster than array("i", ids) does.
    return array("i", struct.pack(f"{n}i", *(ids if n == len(ids) else ids[:n])))


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
    medium: str | None = None  # where the blocks are (kv_events.MEDIUM_*); None: the pool


class TreeNode:
    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access", "salt",
                 "hits", "priority", "tier", "block_keys")

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
        # Where the KV of this span is. POOL: `value` holds its slots. LOCAL / SHARED
        # (offloaded): `value` is empty, the node is never locked, its children are offloaded
        # too, and `block_keys` are the tier keys of the 16-token blocks that END inside it
        # (kv_events' rule; the first may start in the parent).
        self.tier = Tier.POOL
        self.block_keys: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return (f"TreeNode(len={len(self.key)}, tier={self.tier.value}, lock_ref={self.lock_ref}, "
                f"last_access={self.last_access}, children={len(self.children)})")


class MatchResult(NamedTuple):
    node: TreeNode  # deepest matched node: lock it while using `slots`
    cached_len: int  # a multiple of page_size
    slots: list[int]  # slots of token_ids[:cached_len]


class InsertResult(NamedTuple):
    num_already_cached: int  # leading tokens the tree already had before this insert
    node: TreeNode  # the node of the last inserted token


class Demotion(NamedTuple):
    """Where an evicted pool node's KV went: `tier` None means nowhere (drop the node)."""

    tier: Tier | None
    block_keys: tuple[str, ...]  # the keys of the blocks that end inside the node


class TierHooks(Protocol):
    """What the tree tells the tiers (cache/tiers/kv_tiers.py implements it). Both calls run on the
    step thread while the node's pages still hold its KV; `tokens` / `slots` are the whole path
    from the root to the end of the node, whose own span starts at `start`."""

    def on_insert(self, tokens: array[int], slots: array[int], start: int, salt: str) -> None:
        """A pool node was added: publish (write through) its completed blocks."""

    def on_evict(self, tokens: array[int], slots: array[int], start: int, salt: str
                 ) -> Demotion:
        """A pool node is being evicted: demote (write back) its completed blocks."""
