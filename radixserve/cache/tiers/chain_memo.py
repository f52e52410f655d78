"""ChainMemo: the kv_events chain hashes of the tree's paths, computed once and kept.

Owns: a bounded map from a token path (salt + the path's packed tokens, digested in one C
call) to the chain hash of its last whole block. The tiers ask for the hashes of a node's own
blocks; the chain continues from the memo's hash of the node's parent path instead of hashing
the whole path from the root again at every insert, eviction and probe. Does not know: the
tree, stores, keys.

The memo key is the salt and xxh3_128 of the packed prefix: as strong as the
128-bit block keys the tiers already trust; a miss only costs the hashing it saves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import xxhash

from radixserve.kv_events.publisher import DEFAULT_BLOCK_SIZE, chained_hashes

BLOCK = DEFAULT_BLOCK_SIZE
CAPACITY = 1 << 16  # paths remembered (LRU); ~100 bytes each


class ChainMemo:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._last: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.hits = 0

    def span(self, tokens: Sequence[int], salt: str, first: int, end: int
             ) -> tuple[int | None, list[int]]:
        """(hash of block first - 1 or None, hashes of blocks [first, end)) of `tokens`."""
        if first >= end:
            return None, []
        step = 4 * BLOCK
        packed = np.asarray(tokens[: end * BLOCK], dtype="<i4").tobytes()
        chunks = [packed[i * step : (i + 1) * step] for i in range(end)]
        parent = self._get(salt, packed[: first * step]) if first else None
        if first and parent is None:  # the parent path is not remembered: hash it too
            head = chained_hashes(chunks[:first], salt)
            parent = head[-1]
            self._put(salt, packed[: first * step], parent)
        else:
            self.hits += bool(first)
        out = chained_hashes(chunks[first:], salt, parent)
        self._put(salt, packed, out[-1])
        return parent, out

    def _get(self, salt: str, prefix: bytes) -> int | None:
        key = (salt, xxhash.xxh3_128_hexdigest(prefix))
        h = self._last.get(key)
        if h is not None:
            self._last.move_to_end(key)
        return h

    def _put(self, salt: str, prefix: bytes, h: int) -> None:
        key = (salt, xxhash.xxh3_128_hexdigest(prefix))
        self._last[key] = h
        self._last.move_to_end(key)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
