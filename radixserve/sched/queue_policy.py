"""Ordering of the waiting queue: longest-prefix-match with an age guard, or FCFS.

And the in-batch sharing test.

Owns: pure decisions over requests and match lengths. Does not know: pages, tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from radixserve.config import SchedulePolicy
from radixserve.sched.req import Req

LPM_MAX_QUEUE = 128  # past this, matching every waiting request costs more than it saves
AGE_GUARD_SKIPS = 16  # a request passed over this many times goes to the front
SHARE_MIN_TOKENS = 32  # an uncached run this long shared with a chosen request: wait a step


def order_waiting(waiting: Sequence[Req], match_lens: dict[str, int],
                  policy: SchedulePolicy) -> list[Req]:
    """Requests in the order admission should try them.

    Priority first (lower = more important), then lpm: most cached tokens first (ties:
    arrival), or fcfs: arrival. Requests passed over AGE_GUARD_SKIPS times come first in
    arrival order whatever their priority, so neither a miss nor a low priority starves.
    """
    aged = [r for r in waiting if r.num_skips >= AGE_GUARD_SKIPS]
    rest = [r for r in waiting if r.num_skips < AGE_GUARD_SKIPS]
    if policy is SchedulePolicy.FCFS or len(waiting) > LPM_MAX_QUEUE:
        rest.sort(key=lambda r: r.priority)  # stable: arrival order within a priority
    else:
        rest.sort(key=lambda r: (r.priority, -match_lens.get(r.rid, 0), r.arrival))
    return aged + rest


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class SharingIndex:
    """The prompts chosen for one step, bucketed by their first SHARE_MIN_TOKENS tokens.

    A request shares >= SHARE_MIN_TOKENS uncached tokens with a chosen one only if their
    first SHARE_MIN_TOKENS tokens are equal, so it is compared only with its bucket: admitting
    N requests with distinct prompts costs O(N), not O(N^2) comparisons.
    """

    def __init__(self, chosen: Sequence[Req] = ()) -> None:
        self._buckets: dict[tuple[int, ...], list[Req]] = {}
        for req in chosen:
            self.add(req)

    def add(self, req: Req) -> None:
        if req.num_prompt_tokens >= SHARE_MIN_TOKENS:
            key = tuple(req.token_ids[:SHARE_MIN_TOKENS])
            self._buckets.setdefault(key, []).append(req)

    def shares_uncached_prefix(self, req: Req, num_cached: int) -> bool:
        """True when `req` shares >= SHARE_MIN_TOKENS uncached prompt tokens with a chosen
        request. Such a request should wait one step: the chosen one computes the shared part
        and inserts it into the tree, and this one then hits the cache instead of computing
        it again."""
        prompt = req.token_ids[: req.num_prompt_tokens]
        if len(prompt) - num_cached < SHARE_MIN_TOKENS:
            return False
        for other in self._buckets.get(tuple(prompt[:SHARE_MIN_TOKENS]), ()):
            shared = common_prefix_len(prompt, other.token_ids[: other.num_prompt_tokens])
            if shared - num_cached >= SHARE_MIN_TOKENS:
                return True
        return False
