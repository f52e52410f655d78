"""Scheduler: the waiting queue, admission, chunked prefill, decode batches, preemption.

Owns: every Req's lifecycle and the queues. It is the one writer of a request's status and
queue (admitted, started_decoding, retract, end, fail: the only places either changes); its
helpers decide on its behalf and call those: prefill.py (chunks and admission), decode.py
(the decode plan and the persistent view of the running set), preemption.py (victims),
outputs.py (sampled tokens, stop rules); its MemoryManager writes the page fields. Each page
is free (PageAllocator), cached (RadixCache) or held by exactly one request:
`req.slots[req.num_tree_tokens:]`. `req.slots[:req.num_tree_tokens]` are tree pages, locked
through `req.cache_node`. Does not know: tensors (the model runner writes the slot table from
each batch; the scheduler keeps slots and row numbers), sampling, HTTP.

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
from typing import TYPE_CHECKING, Any

from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tiers.kv_tiers import KVTiers
from radixserve.config import EngineConfig
from radixserve.config.speculative_config import SpeculativeConfig
from radixserve.grammar.compiler import GrammarCompiler
from radixserve.lora.namespace import lora_namespace
from radixserve.sched.counters import EngineCounters
from radixserve.sched.decode import DecodeRows, build_rows, plan_decode
from radixserve.sched.lora_gate import LoRAGate
from radixserve.sched.memory import MemoryManager
from radixserve.sched.outputs import advance, process_outputs
from radixserve.sched.pins import PinTable
from radixserve.sched.prefill import plan_prefill
from radixserve.sched.req import Batch, Req, ReqStatus
from radixserve.sched.request_rules import checked_max_new_tokens
from radixserve.sched.speculation import Speculation
from radixserve.sched.tier_loads import TierLoads
from radixserve.types import (
    FinishReason,
    InvalidRequestError,
    Phase,
    SamplingParams,
    TokenLogprobs,
    TokenOutput,
)

if TYPE_CHECKING:
    from radixserve.grammar.backend import Matcher
    from radixserve.lora.peft_format import PeftAdapter

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, cfg: EngineConfig, allocator: PageAllocator, cache: RadixCache,
                 max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 grammars: GrammarCompiler | None = None, tiers: KVTiers | None = None,
                 speculative: SpeculativeConfig | None = None,
                 lora: LoRAGate | None = None) -> None:
        self.cfg = cfg
        self.lora = lora  # None: LoRA off (--enable-lora not given)
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
        self.grammars = grammars  # compiles constrained requests' grammars off the step
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
        self.last_phase = Phase.DECODE  # without mixed steps, prefill and decode alternate
        # The persistent view of `running` (decode.py), rebuilt when its version moves on.
        self._running_version = 0
        self._rows: DecodeRows | None = None

    # ---- requests in and out -------------------------------------------------------------

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams,
            cache_salt: str = "", priority: int = 0,
            prediction_ids: list[int] | None = None, lora_name: str | None = None) -> Req:
        """Validate and queue. Raises InvalidRequestError (the caller's 4xx)."""
        if rid in self.reqs:
            raise InvalidRequestError(f"request id {rid!r} is already in use", "rid")
        if lora_name is not None and (self.lora is None or not self.lora.manager.known(lora_name)):
            raise InvalidRequestError(f"The model `{lora_name}` does not exist.", "model",
                                      status=404)
        max_new = checked_max_new_tokens(prompt_ids, params, self.vocab_size, self.max_model_len)
        if params.constraint is not None:
            if self.grammars is None:
                raise InvalidRequestError("constrained decoding is not available", "constraint")
            self.grammars.request(params.constraint)
        req = Req(rid=rid, token_ids=list(prompt_ids), num_prompt_tokens=len(prompt_ids), params=params,
                  max_new_tokens=max_new, cache_salt=cache_salt, priority=priority,
                  arrival=time.monotonic(), lora_name=lora_name)
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
            self._finish(req, FinishReason.ABORT)
        else:
            self.end(req, FinishReason.ABORT)
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
        want_prefill = bool(self.waiting or self.prefilling)
        if want_prefill and self.running and self.cfg.mixed_chunk:
            return self._plan_mixed()
        if want_prefill and (self.last_phase is Phase.DECODE or not self.running):
            batch = plan_prefill(self)
            if batch is not None:
                self.last_phase = Phase.PREFILL
                return batch
        batch = plan_decode(self)
        if batch is not None:
            self.last_phase = Phase.DECODE
        elif want_prefill:
            batch = plan_prefill(self)
        return batch

    def _plan_mixed(self) -> Batch:
        decode = plan_decode(self)
        assert decode is not None
        budget = min(self.cfg.max_prefill_tokens,
                     self.cfg.chunked_prefill_size or self.cfg.max_prefill_tokens)
        prefill = plan_prefill(self, budget, keep=decode.reqs)
        self.last_phase = Phase.DECODE if prefill is None else Phase.MIXED
        if prefill is None:
            return decode
        return Batch(Phase.MIXED, decode.entries + prefill.entries, num_decodes=decode.size)

    @property
    def running_version(self) -> int:
        """Bumped whenever a request joins or leaves the running set."""
        return self._running_version

    def decode_rows(self) -> DecodeRows:
        """The persistent view of the running set, rebuilt only after it changed."""
        rows = self._rows
        if rows is None or rows.version != self._running_version:
            rows = self._rows = build_rows(self.running, self._running_version,
                                           self.eos_token_ids, self.max_model_len)
        return rows

    # ---- the one writer of a request's status and queue ----------------------------------

    def admitted(self, reqs: list[Req]) -> None:
        """waiting -> prefilling: `reqs` were matched and given their first chunk's pages."""
        if not reqs:
            return
        taken = {id(r) for r in reqs}
        left = [r for r in self.waiting if id(r) not in taken]  # one pass, not one per admit
        self.waiting.clear()
        self.waiting.extend(left)
        for req in reqs:
            self.prefilling.append(req)
            req.status = ReqStatus.RUNNING
            if self.tier_loads is not None:
                self.tier_loads.forget(req)
            if not req.stats_counted:
                req.stats_counted = True
                req.num_cached_tokens = req.num_computed_tokens
                self.counters.prefix_cache_queries += req.num_prompt_tokens
                self.counters.prefix_cache_hits += req.num_computed_tokens
                self.counters.prompt_tokens += req.num_prompt_tokens
        for req in left:  # passed over: ages towards the policy's guard
            req.num_skips += 1

    def started_decoding(self, req: Req) -> None:
        """prefilling -> running: its prompt is computed and its first token sampled."""
        self.prefilling.remove(req)
        if self.lora is None:
            self.running.append(req)
        else:  # one adapter's decodes stay contiguous: one segment per adapter in a step
            self.running.insert(LoRAGate.join_position(self.running, req), req)
        self._running_version += 1

    def retract(self, req: Req) -> None:
        """running/prefilling -> front of waiting, its pages released (preemption)."""
        self._drop_live(req)
        self.mem.release(req)
        self.mem.on_retract(self.running)
        self.waiting.appendleft(req)
        req.status = ReqStatus.WAITING
        req.num_preemptions += 1
        self.counters.num_preemptions += 1

    def end(self, req: Req, reason: FinishReason) -> None:
        """A live request finishes: its pages go to the tree and the allocator."""
        self._drop_live(req)
        self.mem.release(req)
        self._finish(req, reason)

    def fail(self, req: Req, error: str) -> None:
        """A waiting request ends with an error (its grammar did not compile); its client gets
        a 400 at the next step."""
        self.waiting.remove(req)
        self._finish(req, FinishReason.ABORT)
        self.aborted.append((req, error))

    def set_lora(self, req: Req, adapter: PeftAdapter) -> None:
        """Its adapter loaded: the request computes with it, in the adapter's radix namespace
        (set before its first match, so it never shares K/V with the base or another one)."""
        req.lora = adapter
        req.cache_salt = lora_namespace(req.cache_salt, adapter.name, adapter.digest)

    def set_matcher(self, req: Req, matcher: Matcher) -> None:
        req.grammar = matcher  # its grammar compiled: kept until it finishes

    def _drop_live(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
            self._running_version += 1
        elif req in self.prefilling:
            self.prefilling.remove(req)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        self.spec.on_finish(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        req.grammar = None  # the matcher's lifetime ends with the request
        del self.reqs[req.rid]

    # ---- results -------------------------------------------------------------------------

    def process_outputs(self, batch: Batch, token_ids: list[int],
                        logprobs: list[TokenLogprobs | None] | None = None,
                        advanced: bool = False) -> list[TokenOutput]:
        """One token per sampled row (outputs.py)."""
        return process_outputs(self, batch, token_ids, logprobs, advanced)

    def advance(self, batch: Batch) -> None:
        """An overlapped decode step was launched (outputs.advance)."""
        advance(batch)

    def overlappable(self) -> bool:
        """The next step can be a plain decode planned while the last one still runs: no
        prompt waits (prefill and mixed steps run after the last step's outputs), every
        running request's sampling is exact without its last token (DecodeRows.overlap_ok),
        and every one gets its next slot without preempting (a retraction must see the
        request's tokens)."""
        if self.waiting or self.prefilling or self.aborted or not self.running:
            return False
        if not self.decode_rows().overlap_ok:
            return False
        return self.mem.ensure_next_slots(self.running)

    def drain_aborted(self) -> list[TokenOutput]:
        """Outputs of requests that ended without a forward: aborted, or grammar failed."""
        outputs = [TokenOutput(r.rid, None, FinishReason.ABORT, r.num_prompt_tokens,
                               r.num_cached_tokens, error=error) for r, error in self.aborted]
        self.aborted.clear()
        return outputs

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
