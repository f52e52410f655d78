"""Prefill steps: continuing chunked prompts, admitting waiting requests, the chunk budgets.

Owns: the order prefill chunks and admissions are tried in (chunked prompts first, then the
waiting queue in the policy's order), the sharing test that defers a request one step, the
grammar readiness of a constrained request, and the running reservation sum that admission
checks (kept incrementally: one admission adds its own share, so admitting N requests at
once costs O(N), not O(N^2)). Acts on the scheduler's behalf: admissions and retractions go
through Scheduler.admitted / Scheduler.retract (the one writer of a status), pages through
the MemoryManager. Does not know: tensors, sampling, HTTP; the queue order is
queue_policy.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.config import SchedulePolicy
from radixserve.grammar.compiler import CompileFailed
from radixserve.sched.preemption import ensure_or_retract
from radixserve.sched.queue_policy import SharingIndex, order_waiting
from radixserve.sched.req import Batch, Req, ScheduledReq
from radixserve.types import Phase

if TYPE_CHECKING:
    from radixserve.sched.scheduler import Scheduler


def plan_prefill(s: Scheduler, budget: int | None = None,
                 keep: list[Req] | None = None) -> Batch | None:
    """Prefill chunks under `budget` tokens; `keep`: requests no retraction may take."""
    budget = s.cfg.max_prefill_tokens if budget is None else budget
    chunk_cap = s.cfg.chunked_prefill_size or None
    reqs: list[Req] = []
    lens: list[int] = []
    for req in list(s.prefilling):  # continue chunked prompts first
        if req not in s.prefilling:
            continue  # retracted to make room for an earlier one
        n = req.next_chunk_len(budget, chunk_cap)
        if n <= 0 or not ensure_or_retract(s, req, req.num_computed_tokens + n,
                                           reqs + (keep or [])):
            break
        reqs.append(req)
        lens.append(n)
        budget -= n
    if budget > 0 and s.waiting:
        _admit(s, reqs, lens, budget, chunk_cap)
    if not reqs:
        return None
    # The runner rewrites the slot table from the first position it does not hold yet.
    return Batch(Phase.PREFILL, [
        ScheduledReq(r, n, r.num_computed_tokens + n == r.num_tokens,
                     min(r.num_table_slots, r.num_computed_tokens))
        for r, n in zip(reqs, lens, strict=True)])


def _admit(s: Scheduler, reqs: list[Req], lens: list[int], budget: int,
           chunk_cap: int | None) -> None:
    policy = s.cfg.schedule_policy
    mem = s.mem
    matches = {}
    if not s.cfg.disable_radix_cache and policy is SchedulePolicy.LPM:
        matches = {r.rid: mem.peek_match(r) for r in s.waiting}
    live = s.running + s.prefilling
    # Tokens promised to admitted requests; each admission below adds its own share.
    reserved = mem.reserved_tokens(live, reqs, lens)
    newly: list[Req] = []
    chosen = SharingIndex(reqs)
    # LoRA: the adapters the batch's live requests use (at most --max-loras)
    adapters = None if s.lora is None else s.lora.batch_adapters([*live, *reqs])
    for req in order_waiting(s.waiting, matches, policy):
        if budget <= 0 or len(live) >= s.cfg.max_running_requests:
            break
        if not _grammar_ready(s, req):
            continue  # still compiling (or failed): it waits, the batch does not
        if s.lora is not None and adapters is not None and not s.lora.admissible(
                s, req, adapters):
            continue  # its adapter loads (or --max-loras adapters are in use): it waits
        if s.tier_loads is not None and not s.tier_loads.ready(req):
            continue  # its prefix is being read from a tier: it waits, the batch does not
        if reqs and chosen.shares_uncached_prefix(req, matches.get(req.rid, 0)):
            continue
        n = mem.admit(req, budget, chunk_cap, reserved + mem.future_tokens(req),
                      force=not (reqs or live))
        if n == 0:
            break
        reqs.append(req)
        lens.append(n)
        newly.append(req)
        chosen.add(req)
        budget -= n
        reserved += req.num_uncomputed_tokens - n + mem.future_tokens(req)
    s.admitted(newly)
    if s.lora is not None:
        s.lora.trim(s)


def _grammar_ready(s: Scheduler, req: Req) -> bool:
    """Whether req may run: no grammar, or its grammar compiled (its matcher set now). False
    while compiling, or when it failed (the scheduler ends it with the error)."""
    constraint = req.params.constraint
    if constraint is None or req.grammar is not None:
        return True  # a retracted request keeps its matcher, exact with its output
    assert s.grammars is not None
    compiled = s.grammars.poll(constraint)
    if compiled is None:
        return False
    if isinstance(compiled, CompileFailed):
        s.fail(req, f"invalid constraint: {compiled.message}")
        return False
    s.set_matcher(req, compiled.matcher())
    return True
