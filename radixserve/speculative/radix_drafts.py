"""Drafts from what earlier requests produced: tree continuations and recent outputs.

The radix tree's continuations below a request's position, and a bounded index of recent
outputs per cache namespace.

Owns: RecentOutputs (per salt: one ring of recent output tokens, searched by n-gram) and
tree_continuation (a read-only descent: no split, no LRU touch, no lock). Drafts never cross
namespaces (salts): a draft from another tenant's output would leak it through timing.
Does not know: requests, scheduling, verification (a draft is only a guess; every token is
checked by the target model before it is kept).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.radix_types import TreeNode
from radixserve.speculative.ngram import TokenArray, as_tokens, suffix_draft

SEPARATOR = -1  # between outputs in a ring: never a token, so no n-gram spans two outputs
MAX_NAMESPACES = 1024  # least recently used namespaces beyond this are dropped


def _best_child(node: TreeNode) -> TreeNode | None:
    """The most recently used continuation (the likeliest to be produced again)."""
    if not node.children:
        return None
    return max(node.children.values(), key=lambda c: c.last_access)


def _follow(node: TreeNode | None, offset: int, max_draft: int) -> list[int]:
    """Up to max_draft tokens of the path from node.key[offset:] downwards."""
    out: list[int] = []
    while node is not None and len(out) < max_draft:
        out.extend(node.key[offset : offset + max_draft - len(out)])
        node, offset = _best_child(node), 0
    return out


def tree_continuation(cache: RadixCache, token_ids: Sequence[int], salt: str,
                      max_draft: int) -> list[int]:
    """What the tree holds after exactly `token_ids` in namespace `salt` (empty when the
    tree does not contain the whole sequence). Changes nothing in the tree."""
    root = cache.root_for(salt)
    if root is None or max_draft <= 0:
        return []
    node, pos, total = root, 0, len(token_ids)
    while pos < total:
        rest = total - pos
        child = None
        for candidate in _children_at(node, token_ids, pos, cache.page_size):
            span = min(len(candidate.key), rest)
            if list(candidate.key[:span]) == list(token_ids[pos : pos + span]):
                child = candidate
                break
        if child is None:
            return []
        if rest < len(child.key):
            return _follow(child, rest, max_draft)
        node, pos = child, pos + len(child.key)
    return _follow(_best_child(node), 0, max_draft)


def _children_at(node: TreeNode, token_ids: Sequence[int], pos: int,
                 page_size: int) -> list[TreeNode]:
    """The children that may continue token_ids[pos:]: one by its page key, or (the rest is
    shorter than a page) every child, to compare."""
    if page_size == 1:
        child = node.children.get(token_ids[pos])
        return [] if child is None else [child]
    if len(token_ids) - pos >= page_size:
        child = node.children.get(tuple(token_ids[pos : pos + page_size]))
        return [] if child is None else [child]
    return list(node.children.values())


class RecentOutputs:
    """Per namespace, the last `capacity` tokens of finished outputs, separated, searched
    like prompt lookup (the latest occurrence wins). Bounded in tokens per namespace and in
    namespaces."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rings: OrderedDict[str, TokenArray] = OrderedDict()

    def add(self, salt: str, output_ids: Sequence[int]) -> None:
        if self.capacity <= 0 or not output_ids:
            return
        new = as_tokens(list(output_ids)[-self.capacity + 1 :] + [SEPARATOR])
        ring = self._rings.pop(salt, None)
        ring = new if ring is None else np.concatenate([ring, new])[-self.capacity :]
        self._rings[salt] = ring
        while len(self._rings) > MAX_NAMESPACES:
            self._rings.popitem(last=False)

    def draft(self, salt: str, tokens: TokenArray, max_draft: int, n_min: int,
              n_max: int) -> TokenArray:
        ring = self._rings.get(salt)
        if ring is None:
            return tokens[:0]
        draft = suffix_draft(ring, tokens, max_draft, n_min, n_max)
        cut = np.flatnonzero(draft == SEPARATOR)  # an output's end is no token to draft
        return draft[: int(cut[0])] if len(cut) else draft

    def num_tokens(self, salt: str) -> int:
        ring = self._rings.get(salt)
        return 0 if ring is None else len(ring)
