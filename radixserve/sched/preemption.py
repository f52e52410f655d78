"""Preemption: which live request gives its pages back when even eviction cannot make room.

Owns: the victim order (least important first, then the one that loses least) and the loop
that retracts victims until a request's slots fit. The retraction itself (queues, status,
pages) is Scheduler.retract's: the scheduler stays the one writer of a request's status.
Does not know: batches, tensors, sampling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.sched.req import Req

if TYPE_CHECKING:
    from radixserve.sched.scheduler import Scheduler


def ensure_or_retract(s: Scheduler, req: Req, upto: int, keep: list[Req]) -> bool:
    """Slots for req up to `upto`, retracting other live requests (never those in `keep`)
    when even eviction cannot make room. False if nothing is left to retract."""
    while not s.mem.ensure_slots(req, upto):
        victim = pick_victim(s, exclude=[req, *keep])
        if victim is None:
            return False
        s.retract(victim)
    return True


def pick_victim(s: Scheduler, exclude: list[Req]) -> Req | None:
    candidates = [r for r in s.running + s.prefilling if all(r is not e for e in exclude)]
    if not candidates:
        return None
    # The least important request first; among equals the one that loses least: fewest
    # output tokens, least prompt computed, then the longest prompt (most of which stays
    # in the tree and is matched back on resumption).
    return min(candidates, key=lambda r: (-r.priority, r.num_output_tokens,
                                          r.num_computed_tokens, -r.num_prompt_tokens))
