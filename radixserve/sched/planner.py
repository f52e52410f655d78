"""BatchPlanner: decides one step's Batch from the queues it is handed and the memory manager.

Owns: which kind of step runs (PREFILL, DECODE or MIXED, and the alternation without mixed
steps), the order prefill chunks and admissions are tried in, the chunk budgets, victim
choice for preemption, and the StepPlan that reports every decision. It moves requests
between the queues it is handed (waiting -> prefilling on admission, live -> waiting on
retraction, so later decisions of the same step see them where they are) and has the
MemoryManager give or take their pages; everything else about a request (its status, its
counters, its grammar matcher, finishing it) the scheduler sets from the StepPlan.
Does not know: sampling, results, tensors, HTTP; the order of the waiting queue is
policy.py's.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.config import EngineConfig, SchedulePolicy
from radixserve.grammar.compiler import CompileFailed, GrammarCompiler
from radixserve.sched.memory import MemoryManager
from radixserve.sched.queue_policy import order_waiting, shares_uncached_prefix
from radixserve.sched.req import Batch, Req, ScheduledReq
from radixserve.sched.speculation import Speculation
from radixserve.sched.tier_loads import TierLoads
from radixserve.types import Phase

if TYPE_CHECKING:
    from radixserve.grammar.backend import Matcher


class Move(enum.Enum):
    ADMIT = "admit"  # waiting -> prefilling, matched and given its first chunk's pages
    RETRACT = "retract"  # running/prefilling -> front of waiting, its pages released


@dataclass
class StepPlan:
    """What one scheduling decision did and wants; the scheduler applies it in order."""

    batch: Batch | None = None
    moves: list[tuple[Move, Req]] = field(default_factory=list)  # in the order they happened
    matchers: dict[int, tuple[Req, Matcher]] = field(default_factory=dict)  # id(req) -> ...
    failed: dict[int, tuple[Req, str]] = field(default_factory=dict)  # grammar did not compile
    passed_over: list[Req] = field(default_factory=list)  # waited while others were admitted


class BatchPlanner:
    def __init__(self, cfg: EngineConfig, mem: MemoryManager, grammars: GrammarCompiler | None,
                 waiting: deque[Req], prefilling: list[Req], running: list[Req],
                 tier_loads: TierLoads | None = None, spec: Speculation | None = None) -> None:
        self.cfg = cfg
        self.mem = mem
        self.spec = spec  # drafts for decode steps (speculative decoding), like mem: a helper
        self.grammars = grammars
        self.waiting = waiting
        self.prefilling = prefilling  # admitted, prompt not fully computed (chunked)
        self.running = running  # decoding
        self.tier_loads = tier_loads  # prefixes being read back from a tier below the pool
        self.last_phase = Phase.DECODE

    def plan(self) -> StepPlan:
        plan = StepPlan()
        want_prefill = bool(self.waiting or self.prefilling)
        if want_prefill and self.running and self.cfg.mixed_chunk:
            plan.batch = self._plan_mixed(plan)
            return plan
        if want_prefill and (self.last_phase is Phase.DECODE or not self.running):
            plan.batch = self._plan_prefill(plan)
            if plan.batch is not None:
                self.last_phase = Phase.PREFILL
                return plan
        plan.batch = self._plan_decode(plan)
        if plan.batch is not None:
            self.last_phase = Phase.DECODE
        elif want_prefill:
            plan.batch = self._plan_prefill(plan)
        return plan

    def _plan_mixed(self, plan: StepPlan) -> Batch:
        decode = self._plan_decode(plan)
        assert decode is not None
        budget = min(self.cfg.max_prefill_tokens,
                     self.cfg.chunked_prefill_size or self.cfg.max_prefill_tokens)
        prefill = self._plan_prefill(plan, budget, keep=decode.reqs)
        self.last_phase = Phase.DECODE if prefill is None else Phase.MIXED
        if prefill is None:
            return decode
        return Batch(Phase.MIXED, decode.entries + prefill.entries, num_decodes=decode.size)

    def _plan_prefill(self, plan: StepPlan, budget: int | None = None,
                      keep: list[Req] | None = None) -> Batch | None:
        """Prefill chunks under `budget` tokens; `keep`: requests no retraction may take."""
        budget = self.cfg.max_prefill_tokens if budget is None else budget
        chunk_cap = self.cfg.chunked_prefill_size or None
        reqs: list[Req] = []
        lens: list[int] = []
        for req in list(self.prefilling):  # continue chunked prompts first
            if req not in self.prefilling:
                continue  # retracted to make room for an earlier one
            n = req.next_chunk_len(budget, chunk_cap)
            if n <= 0 or not self._ensure_or_retract(
                    plan, req, req.num_computed_tokens + n, reqs + (keep or [])):
                break
            reqs.append(req)
            lens.append(n)
            budget -= n
        if budget > 0 and self.waiting:
            self._admit(plan, reqs, lens, budget, chunk_cap)
        if not reqs:
            return None
        return Batch(Phase.PREFILL, [
            _entry(r, n, sample=r.num_computed_tokens + n == r.num_tokens)
            for r, n in zip(reqs, lens, strict=True)])

    def _admit(self, plan: StepPlan, reqs: list[Req], lens: list[int], budget: int,
               chunk_cap: int | None) -> None:
        policy = self.cfg.schedule_policy
        matches = {}
        if not self.cfg.disable_radix_cache and policy is SchedulePolicy.LPM:
            matches = {r.rid: self.mem.peek_match(r) for r in self.waiting}
        newly: list[Req] = []
        for req in order_waiting(self.waiting, matches, policy):
            if budget <= 0 or len(self.running) + len(self.prefilling) >= self.cfg.max_running_requests:
                break
            if not self._grammar_ready(plan, req):
                continue  # still compiling (or failed): it waits, the batch does not
            if self.tier_loads is not None and not self.tier_loads.ready(req):
                continue  # its prefix is being read from a tier: it waits, the batch does not
            if reqs and shares_uncached_prefix(req, matches.get(req.rid, 0), reqs):
                continue
            live = self.running + self.prefilling
            reserve = self.mem.reserved_tokens(live, reqs, lens) + self.mem.future_tokens(req)
            n = self.mem.admit(req, budget, chunk_cap, reserve,
                               force=not (reqs or self.running or self.prefilling))
            if n == 0:
                break
            reqs.append(req)
            lens.append(n)
            newly.append(req)
            budget -= n
        for req in newly:
            self.waiting.remove(req)
            self.prefilling.append(req)
            plan.moves.append((Move.ADMIT, req))
        if newly:
            plan.passed_over.extend(self.waiting)

    def _grammar_ready(self, plan: StepPlan, req: Req) -> bool:
        """Whether req may run: no grammar, or its grammar compiled (its matcher goes into
        the plan). False while compiling, or when it failed (the plan reports it)."""
        constraint = req.params.constraint
        if constraint is None or req.grammar is not None or id(req) in plan.matchers:
            return True  # a retracted request keeps its matcher, exact with its output
        if id(req) in plan.failed:
            return False
        assert self.grammars is not None
        compiled = self.grammars.poll(constraint)
        if compiled is None:
            return False
        if isinstance(compiled, CompileFailed):
            plan.failed[id(req)] = (req, f"invalid constraint: {compiled.message}")
            return False
        plan.matchers[id(req)] = (req, compiled.matcher())
        return True

    def _plan_decode(self, plan: StepPlan) -> Batch | None:
        if not self.running:
            return None
        self.mem.decay_ratio()
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req not in self.running:
                continue  # retracted to make room for an earlier one
            if not self._ensure_or_retract(plan, req, req.num_computed_tokens + 1, []):
                raise RuntimeError("KV pool too small for a single request")  # sized at start
        # Drafts only after every request has its own next slot: a draft never preempts.
        drafts = self.spec.draft_decodes(self.running, self.mem) if self.spec else []
        if not drafts:
            return Batch(Phase.DECODE, [_entry(r, 1, sample=True) for r in self.running])
        return Batch(Phase.DECODE, [_entry(r, 1 + len(d), sample=True, draft=d)
                                    for r, d in zip(self.running, drafts, strict=True)])

    def _ensure_or_retract(self, plan: StepPlan, req: Req, upto: int, keep: list[Req]) -> bool:
        """Slots for req up to `upto`, retracting other live requests (never those in `keep`)
        when even eviction cannot make room. False if nothing is left to retract."""
        while not self.mem.ensure_slots(req, upto):
            victim = self.pick_victim(exclude=[req, *keep])
            if victim is None:
                return False
            self._retract(plan, victim)
        return True

    def pick_victim(self, exclude: list[Req]) -> Req | None:
        candidates = [r for r in self.running + self.prefilling
                      if all(r is not e for e in exclude)]
        if not candidates:
            return None
        # The least important request first; among equals the one that loses least: fewest
        # output tokens, least prompt computed, then the longest prompt (most of which stays
        # in the tree and is matched back on resumption).
        return min(candidates, key=lambda r: (-r.priority, r.num_output_tokens,
                                              r.num_computed_tokens, -r.num_prompt_tokens))

    def _retract(self, plan: StepPlan, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        else:
            self.prefilling.remove(req)
        self.mem.release(req)
        self.mem.on_retract(self.running)
        self.waiting.appendleft(req)
        plan.moves.append((Move.RETRACT, req))


def _entry(req: Req, n: int, sample: bool, draft: tuple[int, ...] = ()) -> ScheduledReq:
    # The runner rewrites the slot table from the first position it does not hold yet.
    return ScheduledReq(req, n, sample, table_from=min(req.num_table_slots,
                                                       req.num_computed_tokens), draft=draft)
