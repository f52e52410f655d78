"""The engine's view of a request, and the batch the scheduler hands to the model runner.

Owns: Req (mutable; only the scheduler, and its MemoryManager for the page fields, write
it), ReqStatus, ScheduledReq and Batch (not mutated once built: what one forward computes),
the chunk rule.
Does not know: HTTP, tokenizers, tensors. Req compares by identity (eq=False): two requests
with equal fields are still two requests, and `req in list` must not compare token lists.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.types import FinishReason, Phase, SamplingParams

if TYPE_CHECKING:
    from radixserve.cache.radix_cache import TreeNode
    from radixserve.grammar.backend import Matcher
    from radixserve.lora.peft_format import PeftAdapter
    from radixserve.sched.decode import DecodeRows
    from radixserve.speculative.drafter import SpecState


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """One request inside the engine. Only the scheduler mutates it.

    Layout of `token_ids`: [prompt ... | output ...]. The counters, in vLLM's words:
    `num_computed_tokens` tokens have KV in the pool (matched from the radix tree or computed
    by this request), their slots are `slots[:num_computed_tokens]`; the first
    `num_tree_tokens` of those slots belong to the tree (locked through `cache_node`), the
    rest are held by this request; `num_cached_tokens` prompt tokens were served from the
    cache on first admission (what the usage reports).
    """

    rid: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_new_tokens: int  # resolved: params.max_tokens capped by the context
    cache_salt: str = ""
    priority: int = 0  # lower = more important: admitted first, preempted last, cache kept longer
    arrival: float = 0.0
    status: ReqStatus = ReqStatus.WAITING
    num_computed_tokens: int = 0
    num_tree_tokens: int = 0  # leading tokens whose slots the tree owns (locked)
    num_cached_tokens: int = 0  # prompt tokens served from the cache on first admission
    table_row: int = -1  # NOTE: -1 only while not running; asserted on use
    # Leading positions of `slots` that the model runner has written into `table_row` of its
    # slot table; lowered when slots are replaced (a duplicate page adopted from the tree).
    num_table_slots: int = 0
    cache_node: TreeNode | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    slots: list[int] = field(default_factory=list)
    stats_counted: bool = False  # its prompt entered the prefix-cache counters (first admission)
    num_skips: int = 0  # admission rounds it was passed over (the policy's age guard reads it)
    # The grammar state of a constrained request: set at admission once its grammar compiled,
    # advanced with each output token, dropped at finish. Kept across retraction (the output
    # tokens are kept too, so it stays exact).
    grammar: Matcher | None = None
    # Speculative decoding: its prediction, alignment, adaptive draft length and counts;
    # None when nothing drafts for it (no --speculative-config and no prediction).
    spec: SpecState | None = None
    # LoRA: the adapter it names (None: the base model), and the loaded adapter once its load
    # finished (set at admission with the adapter's radix namespace as `cache_salt`).
    lora_name: str | None = None
    lora: PeftAdapter | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still without KV (the next forwards must compute them)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def remain_tokens(self) -> int:
        return self.max_new_tokens - self.num_output_tokens

    def next_chunk_len(self, budget: int, chunk_cap: int | None) -> int:
        """The chunk rule: how many uncomputed tokens the next prefill computes, given the
        step's remaining token budget and the chunk cap (None: no chunking)."""
        n = self.num_uncomputed_tokens
        return min(n, budget, chunk_cap or n)


@dataclass(frozen=True, slots=True)
class ScheduledReq:
    """One request's part of a forward: tokens [req.num_computed_tokens, + num_new_tokens).

    `sample`: a token is sampled after them (its prompt's last chunk, or a decode).
    `table_from`: positions [table_from, num_computed_tokens + num_new_tokens) of req.slots
    must be (re)written into req.table_row of the slot table before the forward.
    `draft` (a decoding request's speculation): the tokens computed after its last one,
    num_new_tokens == 1 + len(draft), a token sampled at every one of those positions (their
    verification). Draft tokens are not in req.token_ids until accepted.
    """

    req: Req
    num_new_tokens: int
    sample: bool
    table_from: int
    draft: tuple[int, ...] = ()


class Batch:
    """What the scheduler hands to the model runner for one forward: one entry per request.

    PREFILL: prompt chunks. DECODE: one token per request. MIXED: a DECODE batch of the first
    `num_decodes` entries followed by prefill chunks. A plain decode step (one token for every
    running request, no drafts) is given as `rows` (the scheduler's persistent view of the
    running set, sched/decode.py) and `positions` (each request's position this step); its
    entries are then built only if something asks for them. Not mutated after it is built.
    """

    def __init__(self, phase: Phase, entries: list[ScheduledReq] | None = None,
                 num_decodes: int = 0, rows: DecodeRows | None = None,
                 positions: list[int] | None = None,
                 lagging: dict[int, int] | None = None) -> None:
        assert (entries is None) == (rows is not None and positions is not None)
        self.phase = phase
        self.num_decodes = num_decodes
        self.rows = rows
        self.positions = positions
        # rows batches: index -> table_from, for the few whose table row lags (see ScheduledReq)
        self.lagging = lagging or {}
        self._entries = entries

    @property
    def entries(self) -> list[ScheduledReq]:
        if self._entries is None:
            assert self.rows is not None and self.positions is not None
            lag = self.lagging
            self._entries = [ScheduledReq(r, 1, True, lag.get(i, p)) for i, (r, p) in
                             enumerate(zip(self.rows.reqs, self.positions, strict=True))]
        return self._entries

    def is_prefill(self, i: int) -> bool:
        """Whether entries[i] computes prompt tokens (PREFILL, or the prefill part of MIXED)."""
        return self.phase is Phase.PREFILL or (self.phase is Phase.MIXED
                                               and i >= self.num_decodes)

    @property
    def reqs(self) -> list[Req]:
        if self.rows is not None:
            return self.rows.reqs
        return [e.req for e in self.entries]

    @property
    def new_token_counts(self) -> list[int]:
        return [e.num_new_tokens for e in self.entries]

    @property
    def has_drafts(self) -> bool:
        return self.rows is None and any(e.draft for e in self.entries)

    @property
    def size(self) -> int:
        return len(self.rows.reqs) if self.rows is not None else len(self.entries)

    @property
    def num_tokens(self) -> int:
        if self.rows is not None:
            return len(self.rows.reqs)
        return sum(e.num_new_tokens for e in self.entries)
