"""Scheduler: the waiting queue, admission, chunked prefill, decode batches, preemption.

Owns: every Req (it is their only mutator), table rows, and the request side of page
ownership. Each page is free (PageAllocator), cached (RadixCache) or held by exactly one
request: `req.slots[req.prefix_len:]`. `req.slots[:req.prefix_len]` are tree pages, locked
through `req.cache_node`. Does not know: tensors beyond the slot table, sampling, HTTP.

One step is EXTEND (prefill chunks of waiting/partially prefilled requests, ordered by
policy, sharing-aware), DECODE (one token for every running request), or, by default while
both kinds of work wait, MIXED: every running request's next token and prefill chunks up to
chunked_prefill_size tokens in one forward (decode-first: the decodes are scheduled first,
the prefill fills the rest). The decodes then ride on the chunk's matmuls instead of waiting
for it, so an inter-token gap is one bounded step. With mixed_chunk off, steps alternate:
after an extend the running requests get a decode step, so a long prefill never starves them.

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
from radixserve.cache.req_table import ReqTable
from radixserve.config import EngineConfig
from radixserve.grammar.compiler import CompileFailed, GrammarCompiler
from radixserve.sched.memory import MemoryManager
from radixserve.sched.pins import PinTable
from radixserve.sched.policy import order_waiting, shares_uncached_prefix
from radixserve.sched.req import Batch, Req, ReqStatus
from radixserve.sched.rules import checked_max_new_tokens, stop_reason
from radixserve.types import (
    FinishReason,
    InvalidRequestError,
    Phase,
    SamplingParams,
    TokenLogprobs,
    TokenOutput,
)

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, cfg: EngineConfig, allocator: PageAllocator, cache: RadixCache,
                 req_table: ReqTable, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], grammars: GrammarCompiler | None = None) -> None:
        self.cfg = cfg
        self.grammars = grammars
        self.mem = MemoryManager(allocator, cache, req_table, cfg.disable_radix_cache)
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
        self.last_phase = Phase.DECODE
        self.counters = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0,
                         "prompt_tokens": 0, "generation_tokens": 0,
                         "computed_tokens": 0, "num_aborted_requests": 0}

    # ---- requests in and out -------------------------------------------------------------

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams,
            cache_salt: str = "", priority: int = 0) -> Req:
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
        self.reqs[rid] = req
        self.waiting.append(req)
        return req

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None or req.status is ReqStatus.FINISHED:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self._drop_live(req)
            self.mem.release(req)
        self._finish(req, FinishReason.ABORT)
        self.counters["num_aborted_requests"] += 1
        self.aborted.append((req, None))

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.aborted)

    def waiting_on_grammars(self) -> bool:
        """Nothing can run until some grammar compiles (the engine may sleep on it)."""
        return (not self.running and not self.prefilling and bool(self.waiting)
                and all(r.params.constraint is not None and r.grammar is None
                        for r in self.waiting))

    # ---- forming batches -----------------------------------------------------------------

    def schedule(self) -> Batch | None:
        if self.pins.pins:
            self.pins.expire()  # lazily: an expired pin only matters when pages are needed
        want_extend = bool(self.waiting or self.prefilling)
        if want_extend and self.running and self.cfg.mixed_chunk:
            return self._schedule_mixed()
        if want_extend and (self.last_phase is Phase.DECODE or not self.running):
            batch = self._schedule_extend()
            if batch is not None:
                self.last_phase = Phase.EXTEND
                return batch
        batch = self._schedule_decode()
        if batch is not None:
            self.last_phase = Phase.DECODE
            return batch
        return self._schedule_extend() if want_extend else None

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

    # ---- results -------------------------------------------------------------------------

    def process_outputs(self, batch: Batch, token_ids: list[int],
                        logprobs: list[TokenLogprobs | None] | None = None) -> list[TokenOutput]:
        outputs = self.drain_aborted()
        sampled = iter(zip(token_ids, logprobs or [None] * len(token_ids), strict=False))
        self.counters["computed_tokens"] += batch.num_tokens
        for i, (req, n, sample) in enumerate(zip(batch.reqs, batch.extend_lens, batch.sample,
                                                 strict=False)):
            req.cached_len += n
            prefill = batch.is_prefill(i)
            if prefill:
                self.mem.cache_progress(req)
            if not sample:
                continue
            token, lp = next(sampled)
            if req.status is ReqStatus.FINISHED:
                continue  # aborted while its forward ran
            req.token_ids.append(token)
            self.counters["generation_tokens"] += 1
            reason = stop_reason(req, token, self.eos_token_ids, self.max_model_len)
            if prefill:
                self.prefilling.remove(req)
                self.running.append(req)
            if reason is not None:
                self._drop_live(req)
                self.mem.release(req)
                self._finish(req, reason)
            outputs.append(TokenOutput(req.rid, token, reason, req.num_prompt_tokens,
                                       req.num_cached_tokens, lp))
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
        return {
            "num_running": len(live), "num_waiting": len(self.waiting),
            "kv_total_tokens": kv.total, "kv_free_tokens": kv.free,
            "kv_cached_tokens": kv.cached, "kv_evictable_tokens": kv.evictable,
            "kv_held_tokens": kv.held, **self.counters,
            # Unlocked cached tokens per cache salt (tenant), for quotas and /metrics.
            "tenant_cached_tokens": self.mem.cache.evictable_by_salt,
            "num_pins": len(self.pins.pins), "pinned_tokens": self.pins.pinned_tokens,
        }

    def check_integrity(self) -> None:
        live = self.running + self.prefilling
        assert all(r.status is ReqStatus.RUNNING for r in live)
        assert all(r.status is ReqStatus.WAITING and not r.slots for r in self.waiting)
        self.mem.check_integrity(live, self.pins.locked_tokens())
