"""Speculation: the scheduler's half of speculative decoding.

Owns: drafting for a decode batch (per request: its adaptive length, the budget left, the
slots the draft needs; per batch: the DraftGate's verdict), turning a verified entry's target
tokens into the tokens it keeps, giving back the slots of rejected tokens, and the
speculative-decoding counters. It acts on the scheduler's behalf (the scheduler owns every
Req; this is its helper, like MemoryManager). Does not know: tensors, sampling, HTTP.

Invariants: a draft token enters req.token_ids only once verified, and only verified tokens
count in req.num_computed_tokens, so the radix tree (fed from token_ids[:num_computed_tokens])
never receives an unverified token. After a verification num_computed_tokens ==
num_tokens - 1 again (the last kept token is computed next step), and req.slots covers no
more than num_tokens rounded up to a page: the slots past it (rejected drafts) are free at
once.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.cache.radix_cache import RadixCache
from radixserve.config.speculative_config import SpeculativeConfig
from radixserve.sched.memory import MemoryManager
from radixserve.sched.req import Batch, Req
from radixserve.speculative.acceptance import DraftGate, accept_prefix
from radixserve.speculative.drafter import Drafter, DraftRequest
from radixserve.types import Phase, TokenOutput


class Speculation:
    def __init__(self, cfg: SpeculativeConfig | None, cache: RadixCache,
                 max_model_len: int) -> None:
        self.cfg = cfg
        self.drafter = Drafter(cfg, cache)
        self.gate = DraftGate()
        self.max_model_len = max_model_len
        self.counters = {"spec_num_drafts": 0, "spec_num_draft_tokens": 0,
                         "spec_num_accepted_tokens": 0, "spec_num_skipped_steps": 0}

    def on_add(self, req: Req, prediction_ids: Sequence[int] | None) -> None:
        if req.params.needs_penalties:
            return  # a penalty depends on every earlier token: not verifiable in one pass
        req.spec = self.drafter.new_state(prediction_ids)

    def draft_decodes(self, reqs: list[Req], mem: MemoryManager) -> list[tuple[int, ...]]:
        """One draft per request of a decode batch (empty: none), its slots allocated.
        Returns [] when no request drafts this step."""
        if not any(r.spec is not None for r in reqs):
            return []
        # The gate rules the server's own sources; a client's prediction always drafts (it
        # asked for it, as OpenAI's Predicted Outputs do).
        gate_open = self.gate.allow(len(reqs))
        if not gate_open:
            self.counters["spec_num_skipped_steps"] += 1
            if not any(r.spec is not None and r.spec.prediction is not None for r in reqs):
                return []
        drafts: list[tuple[int, ...]] = []
        for req in reqs:
            predicted = req.spec is not None and req.spec.prediction is not None
            draft = self._draft(req) if gate_open or predicted else ()
            if draft and not mem.ensure_slots(req, req.num_computed_tokens + 1 + len(draft)):
                draft = ()  # no room: a draft never preempts anyone
            drafts.append(draft)
        return drafts if any(drafts) else []

    def _draft(self, req: Req) -> tuple[int, ...]:
        state = req.spec
        if state is None:
            return ()
        budget = min(req.remain_tokens - 1, self.max_model_len - req.num_tokens - 1)
        if budget <= 0:
            return ()
        k = min(budget, state.length.next_len())
        if k <= 0:
            return ()
        draft = self.drafter.propose(state, DraftRequest(
            req.token_ids, req.num_prompt_tokens, req.cache_salt, req.grammar, k))
        if not draft:
            state.length.observe_empty()
        return tuple(draft)

    def verify(self, req: Req, draft: tuple[int, ...], targets: list[int]) -> list[int]:
        """The tokens req keeps from one verified entry: the accepted draft prefix and the
        target model's token after it. Counts the draft."""
        num_accepted = accept_prefix(draft, targets)
        assert req.spec is not None
        self.drafter.on_verified(req.spec, len(draft), num_accepted)
        self.counters["spec_num_drafts"] += 1
        self.counters["spec_num_draft_tokens"] += len(draft)
        self.counters["spec_num_accepted_tokens"] += num_accepted
        return targets[: num_accepted + 1]

    def after_tokens(self, req: Req, new_tokens: list[int], mem: MemoryManager) -> None:
        """req kept new_tokens (appended, stop rules applied) after a verified entry."""
        req.num_computed_tokens = req.num_table_slots = req.num_tokens - 1
        mem.trim_slots(req, req.num_tokens)
        if req.spec is not None:
            self.drafter.on_tokens(req.spec, req.output_ids, new_tokens)

    def on_tokens(self, req: Req, token: int) -> None:
        """A plain (undrafted) step appended `token`: keep a prediction aligned."""
        if req.spec is not None and req.spec.prediction is not None:
            self.drafter.on_tokens(req.spec, req.output_ids, [token])

    def on_finish(self, req: Req) -> None:
        if req.spec is not None and req.num_output_tokens:
            self.drafter.on_finish(req.cache_salt, req.output_ids)

    def observe_step(self, batch: Batch, outputs: Sequence[TokenOutput], seconds: float) -> None:
        """A decode step's output tokens and duration, for the gate (other steps include
        prefill work and say nothing about drafting). Counted only for a batch that can
        draft: without speculation a step pays no more than this check."""
        if batch.phase is not Phase.DECODE:
            return
        if (batch.rows.any_spec if batch.rows is not None
                else any(r.spec is not None for r in batch.reqs)):
            num_tokens = sum(o.token_id is not None for o in outputs)
            self.gate.observe(batch.size, batch.has_drafts, num_tokens, seconds)

    def stats(self) -> dict[str, float]:
        c = self.counters
        drafts = c["spec_num_drafts"]
        mean = 1 + c["spec_num_accepted_tokens"] / drafts if drafts else 0.0
        return {**c, "spec_mean_acceptance_length": mean}
