"""Scheduler: the waiting queue, admission, chunked prefill, decode batches, preemption.

Owns: every Req (it is their only mutator), table rows, and the request side of page
ownership. Each page is free (PageAllocator), cached (RadixCache) or held by exactly one
request: `req.slots[req.prefix_len:]`. `req.slots[:req.prefix_len]` are tree pages, locked
through `req.cache_node`. Does not know: tensors beyond the slot table, sampling, HTTP.

One step is either EXTEND (prefill chunks of waiting/partially prefilled requests, ordered by
policy, sharing-aware) or DECODE (one token for every running request). After a decode-heavy
stretch a new extend goes first; after an extend, running requests get a decode step, so a
long prefill never starves running streams.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.req_table import ReqTable
from radixserve.config import EngineConfig
from radixserve.sched.memory import MemoryManager
from radixserve.sched.pins import PinTable
from radixserve.sched.policy import order_waiting, shares_uncached_prefix
from radixserve.sched.req import Batch, Req, ReqStatus
from radixserve.types import (
    FinishReason,
    InvalidRequestError,
    Phase,
    SamplingParams,
    TokenLogprobs,
    TokenOutput,
)


class Scheduler:
    def __init__(self, cfg: EngineConfig, allocator: PageAllocator, cache: RadixCache,
                 req_table: ReqTable, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.cfg = cfg
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
        self.aborted: list[Req] = []  # finished by abort, reported at the next step
        self.last_phase = Phase.DECODE
        self.counters = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0,
                         "prompt_tokens": 0, "generation_tokens": 0,
                         "computed_tokens": 0, "num_aborted_requests": 0}

    # ---- requests in and out -------------------------------------------------------------

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams,
            cache_salt: str = "", priority: int = 0) -> Req:
        """Validate and queue. Raises InvalidRequestError (the caller's 4xx)."""
        n = len(prompt_ids)
        if rid in self.reqs:
            raise InvalidRequestError(f"request id {rid!r} is already in use", "rid")
        if n == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        max_new = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max(max_new, 1) > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n + max_new} tokens ({n} in the prompt, {max_new} in the "
                f"completion). Please reduce the prompt or max_tokens.", "max_tokens")
        req = Req(rid=rid, token_ids=list(prompt_ids), num_prompt_tokens=n, params=params,
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
        self.aborted.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.aborted)

    # ---- forming batches -----------------------------------------------------------------

    def schedule(self) -> Batch | None:
        if self.pins.pins:
            self.pins.expire()  # lazily: an expired pin only matters when pages are needed
        want_extend = bool(self.waiting or self.prefilling)
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

    def _schedule_extend(self) -> Batch | None:
        budget = self.cfg.max_prefill_tokens
        chunk_cap = self.cfg.chunked_prefill_size or None
        reqs: list[Req] = []
        lens: list[int] = []
        for req in list(self.prefilling):  # continue chunked prompts first
            if req not in self.prefilling:
                continue  # retracted to make room for an earlier one
            n = min(req.extend_len, budget, chunk_cap or req.extend_len)
            if n <= 0 or not self._ensure_or_retract(req, req.cached_len + n, reqs):
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
            cached = matches.get(req.rid, 0)
            if reqs and shares_uncached_prefix(req, cached, reqs):
                continue
            reserve = self._reserved_tokens(reqs, lens) + self._future_tokens(req)
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

    def _future_tokens(self, req: Req) -> int:
        return int(min(req.remain_tokens, 4096) * self.mem.new_token_ratio)

    def _reserved_tokens(self, batch: list[Req], lens: list[int]) -> int:
        """Tokens promised to admitted requests: the rest of their prompts beyond this step's
        chunk (already allocated) and an estimate of their future decode tokens."""
        this_step = {id(r): n for r, n in zip(batch, lens, strict=True)}
        live = self.running + self.prefilling + [r for r in batch if r not in self.prefilling]
        return sum(r.extend_len - this_step.get(id(r), 0) + self._future_tokens(r) for r in live)

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
        outputs: list[TokenOutput] = [self._abort_output(r) for r in self.aborted]
        self.aborted.clear()
        sampled = iter(zip(token_ids, logprobs or [None] * len(token_ids), strict=False))
        self.counters["computed_tokens"] += batch.num_tokens
        for req, n, sample in zip(batch.reqs, batch.extend_lens, batch.sample, strict=False):
            req.cached_len += n
            if batch.phase is Phase.EXTEND:
                self.mem.cache_progress(req)
            if not sample:
                continue
            token, lp = next(sampled)
            if req.status is ReqStatus.FINISHED:
                continue  # aborted while its forward ran
            req.token_ids.append(token)
            self.counters["generation_tokens"] += 1
            reason = self._stop_reason(req, token)
            if batch.phase is Phase.EXTEND:
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
        outputs = [self._abort_output(r) for r in self.aborted]
        self.aborted.clear()
        return outputs

    def _abort_output(self, req: Req) -> TokenOutput:
        return TokenOutput(req.rid, None, FinishReason.ABORT, req.num_prompt_tokens,
                           req.num_cached_tokens)

    def _stop_reason(self, req: Req, token: int) -> FinishReason | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens and (
            token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        ):
            return FinishReason.STOP
        if req.num_output_tokens >= req.max_new_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _drop_live(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.prefilling:
            self.prefilling.remove(req)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
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
