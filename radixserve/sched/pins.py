"""Pinned prefixes: cached prefixes locked in the radix tree so that eviction never takes them.

Owns: the pins (a tree lock each, the pinned token counts, expiry) and the requests that
prefill a prefix before it can be pinned. The scheduler owns this table as it owns every
other lock on the tree. Does not know: HTTP, admin keys, messages (engine.py answers calls).

A pin is a lock on the node that ends the pinned prefix (whole pages), exactly like a running
request's lock, so every invariant of the tree holds unchanged: pinned pages are "cached",
never "held", and flush/evict simply cannot take them. Pins of overlapping prefixes share
nodes; the cap counts each pin's own length (the conservative sum).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from radixserve.cache.radix_cache import RadixCache, TreeNode
from radixserve.types import InvalidRequestError


@dataclass
class Pin:
    pin_id: str
    token_ids: tuple[int, ...]  # the pinned prefix (whole pages)
    salt: str
    node: TreeNode  # locked while the pin lives
    expires_at: float | None  # time.monotonic() deadline; None: until released

    def describe(self, now: float) -> dict[str, object]:
        ttl = None if self.expires_at is None else max(0.0, self.expires_at - now)
        return {"pin_id": self.pin_id, "num_tokens": len(self.token_ids), "ttl": ttl}


class PinTable:
    def __init__(self, cache: RadixCache, max_pinned_tokens: int) -> None:
        self.cache = cache
        self.max_pinned_tokens = max_pinned_tokens
        self.pins: dict[str, Pin] = {}

    @property
    def pinned_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.pins.values())

    def check_room(self, num_tokens: int) -> None:
        """Raises InvalidRequestError when a pin of num_tokens would pass the cap."""
        if self.pinned_tokens + num_tokens > self.max_pinned_tokens:
            raise InvalidRequestError(
                f"pinning {num_tokens} tokens would exceed the pinnable maximum of "
                f"{self.max_pinned_tokens} tokens ({self.pinned_tokens} pinned now; "
                f"--max-pinned-tokens)", "input_ids")

    def try_pin(self, token_ids: list[int], salt: str, ttl_s: float | None) -> Pin | None:
        """Lock the prefix if the tree holds all of it (whole pages); None if it does not."""
        aligned = len(token_ids) - len(token_ids) % self.cache.page_size
        if aligned == 0:
            raise InvalidRequestError(
                f"a pinned prefix needs at least one whole page "
                f"({self.cache.page_size} tokens)", "input_ids")
        if self.cache.peek_prefix_len(token_ids[:aligned], salt) < aligned:
            return None
        match = self.cache.match_prefix(token_ids[:aligned], salt, priority=None)
        assert match.cached_len == aligned
        self.cache.lock(match.node)
        expires = None if ttl_s is None else time.monotonic() + ttl_s
        pin = Pin(uuid.uuid4().hex, tuple(token_ids[:aligned]), salt, match.node, expires)
        self.pins[pin.pin_id] = pin
        return pin

    def release(self, pin_id: str) -> bool:
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return False
        self.cache.unlock(pin.node)
        return True

    def release_matching(self, token_ids: list[int], salt: str) -> int:
        """Release every pin of exactly this prefix (after page alignment) in this namespace."""
        aligned = len(token_ids) - len(token_ids) % self.cache.page_size
        key = tuple(token_ids[:aligned])
        ids = [p.pin_id for p in self.pins.values() if p.token_ids == key and p.salt == salt]
        for pin_id in ids:
            self.release(pin_id)
        return len(ids)

    def release_all(self) -> int:
        ids = list(self.pins)
        for pin_id in ids:
            self.release(pin_id)
        return len(ids)

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        ids = [p.pin_id for p in self.pins.values()
               if p.expires_at is not None and p.expires_at <= now]
        for pin_id in ids:
            self.release(pin_id)
        return len(ids)

    def locked_tokens(self) -> int:
        """Tokens on the union of the pinned paths (what the pins keep locked in the tree)."""
        seen: set[int] = set()
        total = 0
        for pin in self.pins.values():
            node: TreeNode | None = pin.node
            while node is not None and node.parent is not None and id(node) not in seen:
                seen.add(id(node))
                total += len(node.key)
                node = node.parent
        return total
