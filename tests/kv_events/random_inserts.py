"""Random prompts inserted into a real radix cache, and the blocks it should then publish.

Owns: drawing prompts that extend earlier ones (shared prefixes, two salts), inserting their
page-aligned part with fresh slots, and the expected live block hashes after any mix of
inserts, evictions and resets. Does not know: publishers, sockets, what a test asserts.
"""

from __future__ import annotations

import random

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.radix_types import InsertResult
from radixserve.kv_events.publisher import block_hashes


class RandomInserts:
    """Prompts inserted so far (with their salt); the next one often extends one of them."""

    def __init__(self, cache: RadixCache, page_size: int, rng: random.Random) -> None:
        self.cache, self.page_size, self.rng = cache, page_size, rng
        self.inserted: list[tuple[tuple[int, ...], str]] = []
        self._next_slot = 0

    def insert(self) -> tuple[int, InsertResult]:
        """Insert one random prompt's full pages; returns how many tokens were inserted."""
        rng = self.rng
        base = list(rng.choice(self.inserted)[0]) if self.inserted and rng.random() < 0.7 else []
        seq = tuple(base[: rng.randrange(len(base) + 1)]
                    + [rng.randrange(3) for _ in range(rng.randrange(1, 12))])
        salt = rng.choice(["", "k"])
        n = len(seq) - len(seq) % self.page_size
        res = self.cache.insert(seq[:n], list(range(self._next_slot, self._next_slot + n)), salt)
        self._next_slot += n
        self.inserted.append((seq, salt))
        return n, res

    def expected_blocks(self, block_size: int) -> set[int]:
        """The hashes of every full block of what the cache still holds of the inserts."""
        expected: set[int] = set()
        for seq, salt in self.inserted:
            cached_len = self.cache.match_prefix(seq, salt).cached_len
            expected.update(block_hashes(seq[:cached_len], block_size, salt))
        return expected
