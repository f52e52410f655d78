"""Decode steps: the scheduler's persistent view of its running set (DecodeRows) and the plan
of a decode step (one token for every running request, or a verified draft for some).

Owns: DecodeRows (what stays the same while no request joins or leaves the running set:
the requests in order, their table rows, which of them need more than plain greedy sampling
or more than the vectorized stop test; vLLM V1's persistent batch: rebuilt only when the
set changes, not once per step), the per-step slot allocation of a decode (one allocation
for every request that needs a page, not one per request), and the drafts. Acts on the
scheduler's behalf: retraction goes through Scheduler.retract (the one writer of a status);
pages through the MemoryManager. Does not know: tensors, sampling, HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from radixserve.sched.preemption import ensure_or_retract
from radixserve.sched.req import Batch, Req, ScheduledReq
from radixserve.types import Phase

if TYPE_CHECKING:
    from radixserve.sched.scheduler import Scheduler


@dataclass(frozen=True, eq=False)
class DecodeRows:
    """The running requests, in the scheduler's order, and what is fixed while they run."""

    version: int  # the scheduler's running-set version it was built for
    reqs: list[Req]  # shared, never mutated: the running list when it was built (a copy)
    rows: list[int]  # their slot-table rows
    # Every request greedy, without penalties, logit bias, min_tokens, grammar or logprobs:
    # the sampler takes the argmax of the batch and nothing else.
    plain_sampling: bool
    any_spec: bool  # some request may draft (speculative decoding or a prediction)
    any_logprobs: bool  # some request asks for logprobs (else a step's are all None)
    # The next step may be scheduled and launched before this one's tokens reach the host
    # (overlap scheduling): no request's sampling or drafting reads host state this step's
    # token changes (grammar, penalties, min_tokens, seed, logprobs, drafts).
    overlap_ok: bool
    # The vectorized stop test (outputs.py): a sampled token can end request i only if it is
    # in `stop_ids` (every request's stop and EOS ids), or the request reaches `limits[i]`
    # tokens, or `exact[i]` (a grammar or min_tokens: only the full rule decides).
    stop_ids: np.ndarray  # (S,) int64
    limits: np.ndarray  # (B,) int64: num_tokens at which request i ends by length
    exact: np.ndarray  # (B,) bool
    # What each request's TokenOutput repeats while it runs (fixed from admission on)
    rids: tuple[str, ...]
    prompt_lens: tuple[int, ...]
    cached_lens: tuple[int, ...]


def build_rows(reqs: list[Req], version: int, eos_ids: frozenset[int],
               max_model_len: int) -> DecodeRows:
    stops: set[int] = set()
    for r in reqs:
        stops.update(r.params.stop_token_ids)
        if not r.params.ignore_eos:
            stops.update(eos_ids)
    p = [r.params for r in reqs]
    return DecodeRows(
        version=version, reqs=list(reqs), rows=[r.table_row for r in reqs],
        plain_sampling=all(q.greedy and not q.needs_penalties and not q.logit_bias
                           and q.min_tokens == 0 and q.logprobs is None
                           and r.grammar is None for q, r in zip(p, reqs, strict=True)),
        any_spec=any(r.spec is not None for r in reqs),
        any_logprobs=any(q.logprobs is not None for q in p),
        overlap_ok=all(r.grammar is None and r.spec is None and not q.needs_penalties
                       and q.min_tokens == 0 and q.seed is None and q.logprobs is None
                       and r.params.constraint is None for q, r in zip(p, reqs, strict=True)),
        stop_ids=np.fromiter(sorted(stops), dtype=np.int64, count=len(stops)),
        limits=np.array([min(r.num_prompt_tokens + r.max_new_tokens, max_model_len)
                         for r in reqs], dtype=np.int64).reshape(-1),
        exact=np.array([r.grammar is not None or r.params.min_tokens > 0 for r in reqs],
                       dtype=bool).reshape(-1),
        rids=tuple(r.rid for r in reqs), prompt_lens=tuple(r.num_prompt_tokens for r in reqs),
        cached_lens=tuple(r.num_cached_tokens for r in reqs))


def plan_decode(s: Scheduler) -> Batch | None:
    """One token for every running request (retracting others when even eviction cannot give
    one its next slot), and drafts for those that draft."""
    if not s.running:
        return None
    s.mem.decay_ratio()
    if not s.mem.ensure_next_slots(s.running):
        for req in sorted(s.running, key=lambda r: r.arrival):
            if req not in s.running:
                continue  # retracted to make room for an earlier one
            if not ensure_or_retract(s, req, req.num_computed_tokens + 1, []):
                raise RuntimeError("KV pool too small for a single request")  # sized at start
    rows = s.decode_rows()
    # Drafts only after every request has its own next slot: a draft never preempts.
    drafts = s.spec.draft_decodes(rows.reqs, s.mem) if rows.any_spec else []
    if drafts:
        return Batch(Phase.DECODE, [
            ScheduledReq(r, 1 + len(d), True, min(r.num_table_slots, r.num_computed_tokens),
                         draft=d) for r, d in zip(rows.reqs, drafts, strict=True)])
    positions = [r.num_computed_tokens for r in rows.reqs]
    # The runner rewrites a table row from the first position it does not hold yet: behind
    # the step's position only after a prefill adopted another request's tree pages.
    lagging = {i: r.num_table_slots for i, r in enumerate(rows.reqs)
               if r.num_table_slots < r.num_computed_tokens}
    return Batch(Phase.DECODE, rows=rows, positions=positions, lagging=lagging)
