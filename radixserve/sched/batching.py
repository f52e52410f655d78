"""Batch assembly for the scheduler's steps: prefill chunks (continued chunked prompts, then
admission from the waiting queue), decode batches, mixed batches, and the preemption that
makes room for them.

Owns no state: BatchForming is a base class of Scheduler (scheduler.py), the half of its
methods that builds one step's Batch. Every attribute it reads and writes is declared below
and created by Scheduler.__init__, so the scheduler object stays the only mutator of a Req.
Which kind of step runs (schedule()) and what a step's results do to requests
(process_outputs) stay in scheduler.py. Does not know: the order of the waiting queue
(policy.py), pages (memory.py), tensors, sampling, HTTP.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from radixserve.config import EngineConfig
from radixserve.grammar.compiler import CompileFailed, GrammarCompiler
from radixserve.sched.memory import MemoryManager
from radixserve.sched.policy import order_waiting, shares_uncached_prefix
from radixserve.sched.req import Batch, Req, ReqStatus
from radixserve.types import FinishReason, Phase


class BatchForming:
    # Created and owned by Scheduler.__init__ (see scheduler.py).
    cfg: EngineConfig
    grammars: GrammarCompiler | None
    mem: MemoryManager
    waiting: deque[Req]
    prefilling: list[Req]
    running: list[Req]
    aborted: list[tuple[Req, str | None]]
    last_phase: Phase
    counters: dict[str, int]

    if TYPE_CHECKING:  # defined by Scheduler
        def _drop_live(self, req: Req) -> None: ...
        def _finish(self, req: Req, reason: FinishReason) -> None: ...

    def _schedule_mixed(self) -> Batch | None:
        decode = self._schedule_decode()
        assert decode is not None
        budget = min(self.cfg.max_prefill_tokens,
                     self.cfg.chunked_prefill_size or self.cfg.max_prefill_tokens)
        extend = self._schedule_extend(budget, keep=decode.reqs)
        self.last_phase = Phase.DECODE if extend is None else Phase.MIXED
        if extend is None:
            return decode
        return Batch(Phase.MIXED, decode.reqs + extend.reqs,
                     decode.extend_lens + extend.extend_lens, decode.sample + extend.sample,
                     num_decodes=decode.size)

    def _schedule_extend(self, budget: int | None = None, keep: list[Req] | None = None
                         ) -> Batch | None:
        """Prefill chunks under `budget` tokens; `keep`: requests no retraction may take."""
        budget = self.cfg.max_prefill_tokens if budget is None else budget
        chunk_cap = self.cfg.chunked_prefill_size or None
        reqs: list[Req] = []
        lens: list[int] = []
        for req in list(self.prefilling):  # continue chunked prompts first
            if req not in self.prefilling:
                continue  # retracted to make room for an earlier one
            n = min(req.extend_len, budget, chunk_cap or req.extend_len)
            if n <= 0 or not self._ensure_or_retract(req, req.cached_len + n,
                                                     reqs + (keep or [])):
                break
            reqs.append(req)
            lens.append(n)
            budget -= n
        if budget > 0 and self.waiting:
            self._admit(reqs, lens, budget, chunk_cap)
        if not reqs:
            return None
        sample = [r.cached_len + n == r.num_tokens for r, n in zip(reqs, lens, strict=False)]
        self.mem.write_extend_entries(reqs, lens)
        return Batch(Phase.EXTEND, reqs, lens, sample)

    def _admit(self, reqs: list[Req], lens: list[int], budget: int, chunk_cap: int | None) -> None:
        matches = {}
        if not self.cfg.disable_radix_cache and self.cfg.schedule_policy == "lpm":
            matches = {r.rid: self.mem.peek_match(r) for r in self.waiting}
        newly: list[Req] = []
        for req in order_waiting(self.waiting, matches, self.cfg.schedule_policy):
            if budget <= 0 or len(self.running) + len(self.prefilling) >= self.cfg.max_running_requests:
                break
            if not self._grammar_ready(req):
                continue  # still compiling (or failed): it waits, the batch does not
            cached = matches.get(req.rid, 0)
            if reqs and shares_uncached_prefix(req, cached, reqs):
                continue
            live = self.running + self.prefilling
            reserve = self.mem.reserved_tokens(live, reqs, lens) + self.mem.future_tokens(req)
            n = self.mem.admit(req, budget, chunk_cap, reserve,
                               force=not (reqs or self.running or self.prefilling))
            if n == 0:
                break
            if not req.stats_counted:
                req.stats_counted = True
                req.num_cached_tokens = req.cached_len
                self.counters["prefix_cache_queries"] += req.num_prompt_tokens
                self.counters["prefix_cache_hits"] += req.cached_len
                self.counters["prompt_tokens"] += req.num_prompt_tokens
            req.status = ReqStatus.RUNNING
            reqs.append(req)
            lens.append(n)
            newly.append(req)
            budget -= n
        for req in newly:
            self.waiting.remove(req)
            self.prefilling.append(req)
        if newly:
            for req in self.waiting:  # passed over this round: ages towards the guard
                req.num_skips += 1

    def _grammar_ready(self, req: Req) -> bool:
        """Give req its matcher once its grammar compiled. False while it cannot run."""
        constraint = req.params.constraint
        if constraint is None or req.grammar is not None:
            return True  # a retracted request keeps its matcher, exact with its output
        assert self.grammars is not None
        compiled = self.grammars.poll(constraint)
        if compiled is None:
            return False
        if isinstance(compiled, CompileFailed):  # ends here; its client gets a 400
            self.waiting.remove(req)
            self._finish(req, FinishReason.ABORT)
            self.aborted.append((req, f"invalid constraint: {compiled.message}"))
            return False
        req.grammar = compiled.matcher()
        return True

    def _schedule_decode(self) -> Batch | None:
        if not self.running:
            return None
        self.mem.decay_ratio()
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req not in self.running:
                continue  # retracted to make room for an earlier one
            if not self._ensure_or_retract(req, req.cached_len + 1, []):
                raise RuntimeError("KV pool too small for a single request")  # sized at start
        reqs = list(self.running)
        self.mem.write_decode_entries(reqs)
        return Batch(Phase.DECODE, reqs, [1] * len(reqs), [True] * len(reqs))

    def _ensure_or_retract(self, req: Req, upto: int, keep: list[Req]) -> bool:
        """Slots for req up to `upto`, retracting other live requests (never those in `keep`)
        when even eviction cannot make room. False if nothing is left to retract."""
        while not self.mem.ensure_slots(req, upto):
            victim = self._pick_victim(exclude=[req, *keep])
            if victim is None:
                return False
            self._retract(victim)
        return True

    def _pick_victim(self, exclude: list[Req]) -> Req | None:
        candidates = [r for r in self.running + self.prefilling
                      if all(r is not e for e in exclude)]
        if not candidates:
            return None
        # The least important request first; among equals the one that loses least: fewest
        # output tokens, least prompt computed, then the longest prompt (most of which stays
        # in the tree and is matched back on resumption).
        return min(candidates, key=lambda r: (-r.priority, r.num_output_tokens, r.cached_len,
                                              -r.num_prompt_tokens))

    def _retract(self, req: Req) -> None:
        self._drop_live(req)
        self.mem.release(req)
        req.status = ReqStatus.WAITING
        req.num_preemptions += 1
        self.counters["num_preemptions"] += 1
        self.mem.on_retract(self.running)
        self.waiting.appendleft(req)
