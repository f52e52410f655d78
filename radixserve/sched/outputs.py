"""A step's results: each sampled token appended to its request, the stop rules, the outputs.

Owns: turning one forward's sampled tokens into TokenOutputs: the counters of computed and
generated tokens, moving computed pages into the tree after a prefill chunk, a verified
draft's kept tokens, and the vectorized stop test of a plain decode step (only the requests
a token could end go through the full rule). Acts on the scheduler's behalf: a request that
starts decoding or finishes goes through Scheduler.started_decoding / Scheduler.end (the one
writer of a status). Does not know: tensors (token ids arrive as ints), sampling, HTTP.
"""

from __future__ import annotations

from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from radixserve.sched.req import Batch, Req, ReqStatus
from radixserve.sched.request_rules import stop_reason
from radixserve.types import TokenLogprobs, TokenOutput

if TYPE_CHECKING:
    from radixserve.sched.decode import DecodeRows
    from radixserve.sched.scheduler import Scheduler


def advance(batch: Batch) -> None:
    """An overlapped decode step was launched: its requests' KV now covers one more
    position (whatever token it samples), so the next step can be planned before its tokens
    reach the host; process_outputs(advanced=True) then only appends them."""
    assert batch.rows is not None and not batch.rows.any_spec
    for req in batch.rows.reqs:
        if req.status is not ReqStatus.FINISHED:
            req.num_computed_tokens += 1
            req.num_table_slots = req.num_computed_tokens  # the runner wrote the table row


def process_outputs(s: Scheduler, batch: Batch, token_ids: list[int],
                    logprobs: list[TokenLogprobs | None] | None = None,
                    advanced: bool = False) -> list[TokenOutput]:
    """One token per sampled row: one per request with `sample` set, or 1 + len(draft)
    for a request with a draft (its verification: speculative/acceptance.py). `advanced`:
    a plain decode step that advance() already moved on (overlap scheduling)."""
    outputs = s.drain_aborted()
    s.counters.computed_tokens += batch.num_tokens
    if batch.rows is not None and not batch.rows.any_spec:
        return outputs + _decode_outputs(s, batch, token_ids, logprobs, advanced)
    sampled = iter(zip(token_ids, logprobs or [None] * len(token_ids), strict=True))
    for i, entry in enumerate(batch.entries):
        req = entry.req
        if entry.draft:
            rows = [next(sampled) for _ in range(entry.num_new_tokens)]
            if req.status is not ReqStatus.FINISHED:
                outputs += _keep_verified(s, req, entry.draft, rows)
            continue
        req.num_computed_tokens += entry.num_new_tokens
        req.num_table_slots = req.num_computed_tokens  # the runner wrote the table row
        prefill = batch.is_prefill(i)
        if prefill:
            s.mem.cache_progress(req)
        if not entry.sample:
            continue
        token, lp = next(sampled)
        if req.status is ReqStatus.FINISHED:
            continue  # aborted while its forward ran
        if prefill:
            s.started_decoding(req)
        out = _append(s, req, token, lp)
        if out.finish_reason is None:
            s.spec.on_tokens(req, token)
        outputs.append(out)
    return outputs


def _decode_outputs(s: Scheduler, batch: Batch, token_ids: list[int],
                    logprobs: list[TokenLogprobs | None] | None,
                    advanced: bool = False) -> list[TokenOutput]:
    """A plain decode step (no request drafts): one token per running request. A token can
    end its request only if it is a stop/EOS id of some request, or the request reaches its
    length limit, or the request has a grammar or min_tokens: those go through the full
    rule (stop_reason), the others only append."""
    rows = batch.rows
    assert rows is not None and batch.positions is not None
    tokens = np.asarray(token_ids, dtype=np.int64)  # (B,)
    # After this step request i holds positions[i] + 2 tokens (its last one had no KV).
    full = (np.isin(tokens, rows.stop_ids) | rows.exact
            | (np.asarray(batch.positions, dtype=np.int64) + 2 >= rows.limits))  # (B,)
    # (the sampler hands a list of Nones where no request asks for logprobs)
    if (logprobs is None or not rows.any_logprobs) and rows.version == s.running_version:
        return _live_outputs(s, rows, token_ids, full, advanced)
    outputs: list[TokenOutput] = []
    lps = logprobs if logprobs is not None else [None] * len(token_ids)
    appended = 0
    step = 0 if advanced else 1
    for req, token, check, lp in zip(rows.reqs, token_ids, full.tolist(), lps, strict=True):
        req.num_computed_tokens += step
        req.num_table_slots = req.num_computed_tokens  # the runner wrote the table row
        if req.status is ReqStatus.FINISHED:
            continue  # aborted (or finished one step earlier, overlapped) while it ran
        if check:
            outputs.append(_append(s, req, token, lp))
            continue
        req.token_ids.append(token)
        appended += 1
        outputs.append(TokenOutput(req.rid, token, None, req.num_prompt_tokens,
                                   req.num_cached_tokens, lp))
    s.counters.generation_tokens += appended
    return outputs


def _live_outputs(s: Scheduler, rows: DecodeRows, token_ids: list[int], full: np.ndarray,
                  advanced: bool) -> list[TokenOutput]:
    """_decode_outputs when the running set is the one the step was planned for (so no
    request of it finished or was aborted since) and nothing asks for logprobs: the
    counters and the tokens in one tight loop, the outputs built by map over what the rows
    keep, and only the flagged requests (`full`) through the stop rules."""
    reqs = rows.reqs
    if advanced:  # advance() moved the counters at launch
        for req, token in zip(reqs, token_ids, strict=True):
            req.token_ids.append(token)
    else:
        for req, token in zip(reqs, token_ids, strict=True):
            req.num_table_slots = req.num_computed_tokens = req.num_computed_tokens + 1
            req.token_ids.append(token)
    s.counters.generation_tokens += len(reqs)
    outputs = list(map(TokenOutput, rows.rids, token_ids, repeat(None), rows.prompt_lens,
                       rows.cached_lens))
    for i in np.flatnonzero(full).tolist():
        outputs[i] = _stop(s, reqs[i], token_ids[i], None)
    return outputs


def _append(s: Scheduler, req: Req, token: int, lp: TokenLogprobs | None) -> TokenOutput:
    """Append one kept token, apply the stop rules; finish the request if one fires."""
    req.token_ids.append(token)
    s.counters.generation_tokens += 1
    return _stop(s, req, token, lp)


def _stop(s: Scheduler, req: Req, token: int, lp: TokenLogprobs | None) -> TokenOutput:
    """The stop rules for the token just appended; finish the request if one fires."""
    reason = stop_reason(req, token, s.eos_token_ids, s.max_model_len)
    if reason is not None:
        s.end(req, reason)
    spec = req.spec
    return TokenOutput(req.rid, token, reason, req.num_prompt_tokens, req.num_cached_tokens,
                       lp, num_draft_tokens=spec.num_drafted if spec else 0,
                       num_accepted_draft_tokens=spec.num_accepted if spec else 0)


def _keep_verified(s: Scheduler, req: Req, draft: tuple[int, ...],
                   rows: list[tuple[int, TokenLogprobs | None]]) -> list[TokenOutput]:
    """A running request's verified draft: keep the accepted tokens and the next one,
    each through the stop rules (a stop ends it mid-way; the rest is dropped)."""
    kept = s.spec.verify(req, draft, [t for t, _ in rows])
    outputs: list[TokenOutput] = []
    for token, (_, lp) in zip(kept, rows, strict=False):
        # This forward computed KV for every token before `token`: the last one and the
        # accepted drafts (token is kept[j], whose draft twin was accepted for j < last).
        req.num_computed_tokens = req.num_table_slots = req.num_tokens
        out = _append(s, req, token, lp)
        outputs.append(out)
        if out.finish_reason is not None:
            return outputs
    s.spec.after_tokens(req, kept, s.mem)
    return outputs
