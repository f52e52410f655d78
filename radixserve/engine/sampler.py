"""Turning logits into token ids: bias, penalties, temperature, top-k/p, min-p, seeds.

And the logprobs a request asks for.

Owns: the sampling math, vectorized over the batch (per-request Python work only for the
requests that ask for penalties or a seed). Does not know: the model, the KV cache.
Reads Req (token ids, params); never writes it.

Grammar-constrained rows (req.grammar set) are masked first: one bitmask for the batch, one
vectorized masked_fill (radixserve/grammar/mask.py); the matchers are only read here.

Seeds are stateless: a seeded request's generator is reseeded from (seed, tokens so far) at
every step, so a preempted and recomputed request samples exactly what it would have, and a
speculative step's drafted positions draw what plain steps at those positions would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.grammar.mask import apply_mask, build_mask
from radixserve.platform.kernels import SAMPLING, load_extension
from radixserve.sched.req import Req
from radixserve.types import TokenLogprobs


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


GREEDY_BLOCK = 32  # the CPU argmax's block of the vocabulary (see _greedy)
GreedyArgmax = Callable[[torch.Tensor], torch.Tensor]  # (B, vocab) float32 -> (B,) int64


def load_greedy_argmax(device: torch.device) -> GreedyArgmax | None:
    """The native CPU argmax (engine/csrc/greedy.cpp) at the process's tier; None off CPU or
    where it does not build (then _greedy's torch form)."""
    if device.type != "cpu":
        return None
    loaded = load_extension(SAMPLING)
    return None if loaded is None else loaded.op("greedy_argmax")


def _greedy(logits: torch.Tensor, native: GreedyArgmax | None = None
            ) -> torch.Tensor:  # (B, vocab) -> (B,) int64
    """The first maximal index of each row (HF's argmax; a row with a NaN: its first NaN, as
    torch.max gives it). `native`: load_greedy_argmax()'s op, one pass per row (fp32 logits
    on CPU; figures: bench/README.md "Issue 42"). Else torch.max over a dim returns the first maximal index, as argmax does, but its
    CPU kernel is faster over a large vocabulary; on CPU the row is cut into blocks first: amax
    per block (vectorized), the first block holding the row's max, then the first index of
    that max inside it (half the CPU time of one max over the row at 1024 x 1024)."""
    rows, vocab = logits.shape
    if native is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1 and (
            logits.device.type == "cpu" and vocab > 0):
        return native(logits)
    if logits.device.type != "cpu" or vocab % GREEDY_BLOCK or not logits.is_contiguous():
        return logits.max(dim=-1).indices
    blocks = logits.view(rows, vocab // GREEDY_BLOCK, GREEDY_BLOCK)  # (B, nb, 32)
    best, block = blocks.amax(-1).max(-1)  # (B,) each: the max, its first block
    inside = blocks.gather(1, block.view(rows, 1, 1).expand(rows, 1, GREEDY_BLOCK)
                           ).view(rows, GREEDY_BLOCK)  # (B, 32): that block's logits
    first = (inside == best[:, None]).to(torch.uint8).argmax(-1)  # (B,) first match
    return block * GREEDY_BLOCK + first


def _add_logit_bias(logits: torch.Tensor, reqs: list[Req]) -> None:
    """Every request's logit_bias in one scatter-add over (row, token) pairs; logits (B, V)."""
    entries = [(i, tok, bias) for i, r in enumerate(reqs) for tok, bias in r.params.bias_pairs]
    if not entries:
        return
    rows, toks, vals = zip(*entries, strict=True)
    index = torch.tensor([rows, toks], dtype=torch.int64, device=logits.device)  # (2, E)
    logits.index_put_((index[0], index[1]),
                      torch.tensor(vals, dtype=logits.dtype, device=logits.device),
                      accumulate=True)


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], seed: int, device: torch.device) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._argmax = load_greedy_argmax(device)  # None: the torch form

    def sample(self, logits: torch.Tensor, reqs: list[Req],
               drafts: list[tuple[int, ...]] | None = None, plain: bool = False) -> SampleResult:
        """logits: (R, vocab) float32, in order: one row per request, or with `drafts`
        1 + len(drafts[i]) rows for request i (row j: its next token after drafts[i][:j];
        speculative verification, see speculative/acceptance.py). Returns one token per row.
        `plain`: the caller knows every request is greedy with nothing else to apply (no
        penalties, bias, min_tokens, grammar or logprobs): the argmax, without looking at
        each request."""
        if plain:
            return SampleResult(_greedy(logits, self._argmax).tolist(), [None] * len(reqs))
        raw = logits
        offsets = [0] * len(reqs)
        if drafts is not None and any(drafts):
            rows = [(r, j) for r, d in zip(reqs, drafts, strict=True) for j in range(len(d) + 1)]
            offsets = [j for _, j in rows]
        else:
            rows, drafts = [(r, 0) for r in reqs], None
        row_reqs = [r for r, _ in rows]
        mask = build_mask([r.grammar for r in reqs], logits.shape[-1], logits.device, drafts)
        if mask is not None:
            # Logprobs stay those of the raw model distribution; copy only when one is asked.
            wants_raw = any(r.grammar is not None and r.params.logprobs is not None for r in reqs)
            with torch.inference_mode():  # logits come out of the forward as inference tensors
                logits = logits.clone() if wants_raw else logits
                apply_mask(logits, mask)
        token_ids = self._choose(logits, row_reqs, offsets)
        return SampleResult(token_ids, self._logprobs(raw, row_reqs, token_ids))

    def sample_tensor(self, logits: torch.Tensor, reqs: list[Req], plain: bool
                      ) -> torch.Tensor:  # (R,) int64 on the logits' device
        """One token per row, left on the device (an overlapped step: no host sync). Only for
        requests whose sampling reads no host state that the step before may change: no
        grammar, penalties, min_tokens, seed or logprobs (DecodeRows.overlap_ok)."""
        if plain:
            return _greedy(logits, self._argmax)
        return self._choose_tensor(logits, reqs, [0] * len(reqs))

    def _choose(self, logits: torch.Tensor, reqs: list[Req], offsets: list[int]) -> list[int]:
        """`offsets[i]`: how many draft tokens row i's position lies past reqs[i]'s tokens."""
        result: list[int] = self._choose_tensor(logits, reqs, offsets).tolist()
        return result

    def _choose_tensor(self, logits: torch.Tensor, reqs: list[Req], offsets: list[int]
                       ) -> torch.Tensor:  # (R,)
        params = [r.params for r in reqs]
        if all(p.greedy and not p.needs_penalties and p.min_tokens == 0 and not p.logit_bias
               for p in params):
            return _greedy(logits, self._argmax)
        logits = logits.clone()
        _add_logit_bias(logits, reqs)
        for i, r in enumerate(reqs):
            if r.params.needs_penalties:
                assert offsets[i] == 0, "no drafts for requests with penalties"
                self._apply_penalties(logits[i], r)
            if r.num_output_tokens + offsets[i] < r.params.min_tokens and r.grammar is None:
                # (a grammar decides where a constrained output may end)
                banned = list(r.params.stop_token_ids) + list(self.eos_token_ids)
                logits[i, banned] = float("-inf")
        token_ids = _greedy(logits, self._argmax)  # (R,)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            probs = self._filtered_probs(logits[rows], [reqs[i] for i in sampled_rows])
            token_ids[rows] = self._draw(probs, [reqs[i] for i in sampled_rows],
                                         [offsets[i] for i in sampled_rows])
        return token_ids

    def _apply_penalties(self, row: torch.Tensor, req: Req) -> None:
        p = req.params
        vocab = row.shape[0]
        out = torch.tensor(req.output_ids, dtype=torch.int64, device=row.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)  # (vocab,)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.repetition_penalty != 1.0:
            # vLLM semantics: every token seen in the prompt or the output is penalized.
            seen = torch.tensor(sorted(set(req.token_ids)), dtype=torch.int64, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )

    def _filtered_probs(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in reqs], device=logits.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)  # (N, vocab)
        top_k = [r.params.top_k for r in reqs]
        top_p = [r.params.top_p for r in reqs]
        min_p = [r.params.min_p for r in reqs]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
            k = torch.tensor([k if k > 0 else probs.shape[-1] for k in top_k], device=probs.device)
            drop = ranks >= k[:, None]
            # Keep a token while the mass strictly before it is below top_p (so >= 1 survives).
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= before >= torch.tensor(top_p, device=probs.device)[:, None]
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        if any(m > 0 for m in min_p):
            floor = torch.tensor(min_p, device=probs.device)[:, None] * probs.amax(-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True)

    def _draw(self, probs: torch.Tensor, reqs: list[Req], offsets: list[int]) -> torch.Tensor:
        out = torch.empty(len(reqs), dtype=torch.int64, device=probs.device)
        unseeded = [i for i, r in enumerate(reqs) if r.params.seed is None]
        if unseeded:
            idx = torch.tensor(unseeded, device=probs.device)
            out[idx] = torch.multinomial(probs[idx], 1, generator=self.generator).squeeze(1)
        for i, r in enumerate(reqs):
            if r.params.seed is not None:
                # Seeded by the position sampled, so a drafted position draws what a plain
                # step at that position would (speculative/acceptance.py relies on it).
                g = torch.Generator(device=probs.device)
                g.manual_seed((r.params.seed * 1_000_003 + r.num_tokens + offsets[i]) % (2**63))
                out[i] = torch.multinomial(probs[i], 1, generator=g)[0]
        return out

    def _logprobs(self, logits: torch.Tensor, reqs: list[Req],
                  token_ids: list[int]) -> list[TokenLogprobs | None]:
        """Logprobs of the raw model distribution (vLLM's default), for requests that ask."""
        result: list[TokenLogprobs | None] = [None] * len(reqs)
        wanted = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not wanted:
            return result
        lp = torch.log_softmax(logits[torch.tensor(wanted, device=logits.device)], dim=-1)
        for j, i in enumerate(wanted):
            n = reqs[i].params.logprobs or 0
            top_vals, top_ids = lp[j].topk(n)
            top = tuple(zip(top_ids.tolist(), top_vals.tolist(), strict=False))
            result[i] = TokenLogprobs(float(lp[j, token_ids[i]]), top)
        return result
