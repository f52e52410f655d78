"""Scheduler: the waiting queue, admission, chunked prefill, decode batches, preemption.

Owns: every Req's lifecycle (it is their only mutator: status, queues, finish, counters,
grammar matchers; its MemoryManager writes the page fields on its behalf), and the request
side of page ownership. Each page is free (PageAllocator), cached (RadixCache) or held by
exactly one request: `req.slots[req.num_tree_tokens:]`. `req.slots[:req.num_tree_tokens]`
are tree pages, locked through `req.cache_node`. Does not know: tensors (the model runner
writes the slot table from each batch; the scheduler keeps slots and row numbers), sampling,
HTTP. Which requests a step runs is decided by its BatchPlanner (planner.py), which returns
a StepPlan; schedule() here applies it to the requests.

One step is PREFILL (chunks of waiting/partially prefilled prompts, ordered by
policy, sharing-aware), DECODE (one token for every running request), or, by default while
both kinds of work wait, MIXED: every running request's next token and prefill chunks up to
chunked_prefill_size tokens in one forward (decode-first: the decodes are scheduled first,
the prefill fills the rest). The decodes then ride on the chunk's matmuls instead of waiting
for it, so an inter-token gap is one bounded step. With mixed_chunk off, steps alternate:
after a prefill the running requests get a decode step, so a long prefill never starves them.

Grammar-constrained requests: the grammar compiles off the step loop (GrammarCompiler); a
request waits in the queue until its grammar is ready (the batch never waits), gets its
matcher at admission, advances it with each sampled token here (the sampler only reads it)
and drops it at finish. A grammar that fails to compile ends its request with an error
output (the engine process turns it into a 400 for that request only).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tiers.kv_tiers import KVTiers
from radixserve.config import EngineConfig
from radixserve.config.speculative_config import SpeculativeConfig
from radixserve.grammar.compiler import GrammarCompiler
from radixserve.sched.counters import EngineCounters
from radixserve.sched.memory import MemoryManager
from radixserve.sched.pins import PinTable
from radixserve.sched.planner import BatchPlanner, Move, StepPlan
from radixserve.sched.req import Batch, Req, ReqStatus
from radixserve.sched.request_rules import checked_max_new_tokens, stop_reason
from radixserve.sched.speculation import Speculation
from radixserve.sched.tier_loads import TierLoads
from radixserve.types import (
    FinishReason,
    InvalidRequestError,
    SamplingParams,
    TokenLogprobs,
    TokenOutput,
)

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, cfg: EngineConfig, allocator: PageAllocator, cache: RadixCache,
                 max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 grammars: GrammarCompiler | None = None, tiers: KVTiers | None = None,
                 speculative: SpeculativeConfig | None = None) -> None:
        self.cfg = cfg
        # One slot-table row per running request (the model runner's table has as many).
        self.mem = MemoryManager(allocator, cache, cfg.max_running_requests,
                                 cfg.disable_radix_cache)
        self.spec = Speculation(speculative, cache, max_model_len)
        max_pinned = cfg.max_pinned_tokens
        if max_pinned is None:
            max_pinned = allocator.num_pages * allocator.page_size // 4
        self.pins = PinTable(cache, max_pinned)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []  # admitted, prompt not fully computed (chunked)
        self.running: list[Req] = []  # decoding
        self.reqs: dict[str, Req] = {}
        # Finished without a forward (aborted, or its grammar failed to compile: the error),
        # reported at the next step.
        self.aborted: list[tuple[Req, str | None]] = []
        self.counters = EngineCounters()
        # Requests whose prefix continues in a tier wait here while a worker loads it.
        self.tier_loads = None if tiers is None else TierLoads(tiers, self.mem)
        self.planner = BatchPlanner(cfg, self.mem, grammars, self.waiting, self.prefilling,
                                    self.running, self.tier_loads, self.spec)

    @property
    def grammars(self) -> GrammarCompiler | None:
        """The compiler of constrained requests' grammars (the planner polls the same one)."""
        return self.planner.grammars

    @grammars.setter
    def grammars(self, compiler: GrammarCompiler | None) -> None:
        self.planner.grammars = compiler

    # ---- requests in and out -------------------------------------------------------------

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams,
            cache_salt: str = "", priority: int = 0,
            prediction_ids: list[int] | None = None) -> Req:
        """Validate and queue. Raises InvalidRequestError (the caller's 4xx)."""
        if rid in self.reqs:
            raise InvalidRequestError(f"request id {rid!r} is already in use", "rid")
        max_new = checked_max_new_tokens(prompt_ids, params, self.vocab_size, self.max_model_len)
        if params.constraint is not None:
            if self.grammars is None:
                raise InvalidRequestError("constrained decoding is not available", "constraint")
            self.grammars.request(params.constraint)
        req = Req(rid=rid, token_ids=list(prompt_ids), num_prompt_tokens=len(prompt_ids), params=params,
                  max_new_tokens=max_new, cache_salt=cache_salt, priority=priority,
                  arrival=time.monotonic())
        self.spec.on_add(req, prediction_ids)
        self.reqs[rid] = req
        self.waiting.append(req)
        return req

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None or req.status is ReqStatus.FINISHED:
            return
        if req in self.waiting:
            self.waiting.remove(req)
            if self.tier_loads is not None:
                self.tier_loads.forget(req)  # a load still running finishes as an orphan
        else:
            self._drop_live(req)
            self.mem.release(req)
        self._finish(req, FinishReason.ABORT)
        self.counters.num_aborted_requests += 1
        self.aborted.append((req, None))

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.aborted
                    or (self.tier_loads is not None and self.tier_loads.busy()))

    def waiting_on_loads(self) -> bool:
        """Nothing can run until a tier load finishes (the engine may sleep on it)."""
        return (self.tier_loads is not None and self.tier_loads.busy()
                and not self.running and not self.prefilling)

    def waiting_on_grammars(self) -> bool:
        """Nothing can run until some grammar compiles (the engine may sleep on it)."""
        return (not self.running and not self.prefilling and bool(self.waiting)
                and all(r.params.constraint is not None and r.grammar is None
                        for r in self.waiting))

    # ---- forming batches -----------------------------------------------------------------

    def schedule(self) -> Batch | None:
        if self.pins.pins:
            self.pins.expire()  # lazily: an expired pin only matters when pages are needed
        if self.tier_loads is not None:
            self.tier_loads.sync()
        plan = self.planner.plan()
        self._apply(plan)
        return plan.batch

    def _apply(self, plan: StepPlan) -> None:
        """Set what the planner decided on the requests (it only moved them and their pages)."""
        for req, matcher in plan.matchers.values():
            req.grammar = matcher
        for move, req in plan.moves:
            if move is Move.RETRACT:
                req.status = ReqStatus.WAITING
                req.num_preemptions += 1
                self.counters.num_preemptions += 1
                continue
            req.status = ReqStatus.RUNNING
            if self.tier_loads is not None:
                self.tier_loads.forget(req)
            if not req.stats_counted:
                req.stats_counted = True
                req.num_cached_tokens = req.num_computed_tokens
                self.counters.prefix_cache_queries += req.num_prompt_tokens
                self.counters.prefix_cache_hits += req.num_computed_tokens
                self.counters.prompt_tokens += req.num_prompt_tokens
        for req in plan.passed_over:  # ages towards the policy's guard
            req.num_skips += 1
        for req, error in plan.failed.values():  # ends here; its client gets a 400
            self.waiting.remove(req)
            self._finish(req, FinishReason.ABORT)
            self.aborted.append((req, error))

    # ---- results -------------------------------------------------------------------------

    def process_outputs(self, batch: Batch, token_ids: list[int],
                        logprobs: list[TokenLogprobs | None] | None = None) -> list[TokenOutput]:
        """One token per sampled row: one per request with `sample` set, or 1 + len(draft)
        for a request with a draft (its verification: speculative/acceptance.py)."""
        outputs = self.drain_aborted()
        sampled = iter(zip(token_ids, logprobs or [None] * len(token_ids), strict=True))
        self.counters.computed_tokens += batch.num_tokens
        for i, entry in enumerate(batch.entries):
            req = entry.req
            if entry.draft:
                rows = [next(sampled) for _ in range(entry.num_new_tokens)]
                if req.status is not ReqStatus.FINISHED:
                    outputs += self._keep_verified(req, entry.draft, rows)
                continue
            req.num_computed_tokens += entry.num_new_tokens
            req.num_table_slots = req.num_computed_tokens  # the runner wrote the table row
            prefill = batch.is_prefill(i)
            if prefill:
                self.mem.cache_progress(req)
            if not entry.sample:
                continue
            token, lp = next(sampled)
            if req.status is ReqStatus.FINISHED:
                continue  # aborted while its forward ran
            if prefill:
                self.prefilling.remove(req)
                self.running.append(req)
            out = self._append(req, token, lp)
            if out.finish_reason is None:
                self.spec.on_tokens(req, token)
            outputs.append(out)
        return outputs

    def _append(self, req: Req, token: int, lp: TokenLogprobs | None) -> TokenOutput:
        """Append one kept token, apply the stop rules; finish the request if one fires."""
        req.token_ids.append(token)
        self.counters.generation_tokens += 1
        reason = stop_reason(req, token, self.eos_token_ids, self.max_model_len)
        if reason is not None:
            self._drop_live(req)
            self.mem.release(req)
            self._finish(req, reason)
        spec = req.spec
        return TokenOutput(req.rid, token, reason, req.num_prompt_tokens, req.num_cached_tokens,
                           lp, num_draft_tokens=spec.num_drafted if spec else 0,
                           num_accepted_draft_tokens=spec.num_accepted if spec else 0)

    def _keep_verified(self, req: Req, draft: tuple[int, ...],
                       rows: list[tuple[int, TokenLogprobs | None]]) -> list[TokenOutput]:
        """A running request's verified draft: keep the accepted tokens and the next one,
        each through the stop rules (a stop ends it mid-way; the rest is dropped)."""
        kept = self.spec.verify(req, draft, [t for t, _ in rows])
        outputs: list[TokenOutput] = []
        for token, (_, lp) in zip(kept, rows, strict=False):
            # This forward computed KV for every token before `token`: the last one and the
            # accepted drafts (token is kept[j], whose draft twin was accepted for j < last).
            req.num_computed_tokens = req.num_table_slots = req.num_tokens
            out = self._append(req, token, lp)
            outputs.append(out)
            if out.finish_reason is not None:
                return outputs
        self.spec.after_tokens(req, kept, self.mem)
        return outputs

    def drain_aborted(self) -> list[TokenOutput]:
        """Outputs of requests that ended without a forward: aborted, or grammar failed."""
        outputs = [TokenOutput(r.rid, None, FinishReason.ABORT, r.num_prompt_tokens,
                               r.num_cached_tokens, error=error) for r, error in self.aborted]
        self.aborted.clear()
        return outputs

    def _drop_live(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.prefilling:
            self.prefilling.remove(req)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        self.spec.on_finish(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        req.grammar = None  # the matcher's lifetime ends with the request
        del self.reqs[req.rid]

    def flush_cache(self, include_pins: bool = False) -> bool:
        """Drop every cached prefix but the pinned ones (all, with include_pins). False
        (nothing done) while requests are admitted."""
        if self.running or self.prefilling:
            return False
        if include_pins:
            self.pins.release_all()
        self.mem.flush_cache()
        return True

    def stats(self) -> dict[str, Any]:
        live = self.running + self.prefilling
        kv = self.mem.usage(live)
        loading = 0 if self.tier_loads is None else len(self.tier_loads.held_slots())
        return {
            "num_running": len(live), "num_waiting": len(self.waiting),
            "kv_total_tokens": kv.total, "kv_free_tokens": kv.free,
            "kv_cached_tokens": kv.cached, "kv_evictable_tokens": kv.evictable,
            "kv_held_tokens": kv.held + loading, **self.counters.as_stats(), **self.spec.stats(),
            # Unlocked cached tokens per cache salt (tenant), for quotas and /metrics.
            "tenant_cached_tokens": self.mem.cache.evictable_by_salt,
            "num_pins": len(self.pins.pins), "pinned_tokens": self.pins.pinned_tokens,
        }

    def check_integrity(self) -> None:
        live = self.running + self.prefilling
        assert all(r.status is ReqStatus.RUNNING for r in live)
        assert all(r.status is ReqStatus.WAITING and not r.slots for r in self.waiting)
        loads = self.tier_loads
        if loads is None:
            self.mem.check_integrity(live, self.pins.locked_tokens())
            return
        idle = loads.tiers.writer.idle()
        if idle:
            loads.tiers.check_stores()
        loads.sync()  # the tree forgets what the stores dropped
        self.mem.check_integrity(live, self.pins.locked_tokens(), loads.held_slots())
        if idle and loads.tiers.writer.idle():
            loads.tiers.check_tree(self.mem.cache.tier_keys())
