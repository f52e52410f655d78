"""One choice seen from the API server: a ChoiceJob's tokens in, text chunks out.

Owns: ChoiceChunk (what a route formats) and stream_choice (detokenize, honour stop strings,
time the request, abort when it stops early). ChoiceJob and merging n choices into one stream
are radixserve/api/jobs.py's. Does not know: HTTP, OpenAI's wire format.

Abort rule: a choice is aborted in the engine exactly when its consumer stops before the
engine finished it (stop string, client gone, error elsewhere): EngineClient.generate aborts
in its finally, and every generator here is driven under `aclosing` so that happens at once,
not whenever the garbage collector gets to it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from radixserve.api.jobs import ChoiceJob
from radixserve.ipc.messages import GenerateMsg
from radixserve.server.detokenizer import Decoder, IncrementalDetokenizer, StopMatcher
from radixserve.server.metrics import ServerMetrics
from radixserve.types import FinishReason, TokenLogprobs, TokenOutput

T = TypeVar("T")


class GenerateClient(Protocol):
    def generate(self, msg: GenerateMsg) -> AsyncGenerator[TokenOutput, None]: ...


@dataclass
class ChoiceChunk:
    """Text that became final, with the tokens (and their logprobs) that produced it.

    The first chunk of a choice comes with its first engine output, even when its text is held
    back, so a route learns early that the request was accepted.
    """

    index: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Speculative decoding over the choice so far: draft tokens verified, and accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


class _Timer:
    """TTFT / ITL / E2E for one choice, observed into the server's histograms."""

    def __init__(self, metrics: ServerMetrics | None, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._last: float | None = None

    def on_token(self) -> None:
        now = time.perf_counter()
        if self._metrics is not None:
            if self._last is None:
                self._metrics.ttft.observe(now - self._arrival)
            else:
                self._metrics.itl.observe(now - self._last)
        self._last = now

    def done(self, finish_reason: str) -> None:
        """Count a finished request; one the engine rejected (no token) is not counted."""
        if self._metrics is not None and self._last is not None:
            self._metrics.e2e.observe(time.perf_counter() - self._arrival)
            self._metrics.request_success.labels(finish_reason).inc()


def _text_state(tokenizer: Decoder, job: ChoiceJob
                ) -> tuple[IncrementalDetokenizer, StopMatcher]:
    """The detokenizer and stop matcher, for a continuation (`num_continued`) in the state
    the interrupted stream left them: the text it still held back (a stop string's possible
    start, a character's first bytes) is held again, and a stop string straddling the break
    is found; the text it had sent is not sent again."""
    cut = len(job.prompt_ids) - job.num_continued
    detok = IncrementalDetokenizer(tokenizer, job.prompt_ids[:cut])
    stopper = StopMatcher(job.stop)
    for token_id in job.prompt_ids[cut:]:
        stopper.push(detok.push(token_id))
    return detok, stopper


async def stream_choice(client: GenerateClient, tokenizer: Decoder, job: ChoiceJob,
                        hidden_ids: Sequence[int] = (), metrics: ServerMetrics | None = None,
                        arrival: float | None = None) -> AsyncGenerator[ChoiceChunk, None]:
    """Run one choice; `hidden_ids` (EOS) never reach the text when they end the request."""
    detok, stopper = _text_state(tokenizer, job)
    hidden = set(hidden_ids) | set(job.params.stop_token_ids)
    timer = _Timer(metrics, time.perf_counter() if arrival is None else arrival)
    msg = GenerateMsg(job.rid, list(job.prompt_ids), job.params, job.cache_salt, job.priority,
                      list(job.prediction_ids) or None, lora_name=job.lora_name)
    chunk = ChoiceChunk(job.index, "")
    first, finish = True, None
    try:
        async with aclosing(client.generate(msg)) as outputs:
            async for out in outputs:
                text = ""
                if out.token_id is not None:
                    timer.on_token()
                    chunk.token_ids.append(out.token_id)
                    chunk.logprobs.append(out.logprobs)
                    ends = out.finish_reason is FinishReason.STOP and out.token_id in hidden
                    if not ends:
                        text = detok.push(out.token_id)
                if out.finish_reason is not None:
                    text += detok.flush()
                result = stopper.push(text, final=out.finish_reason is not None)
                if result.stopped:
                    finish = FinishReason.STOP.value
                elif out.finish_reason is not None:
                    finish = out.finish_reason.value
                if result.text or finish or first:
                    chunk.text, chunk.finish_reason = result.text, finish
                    chunk.num_prompt_tokens = out.num_prompt_tokens
                    chunk.num_cached_tokens = out.num_cached_tokens
                    chunk.num_draft_tokens = out.num_draft_tokens
                    chunk.num_accepted_draft_tokens = out.num_accepted_draft_tokens
                    yield chunk
                    chunk, first = ChoiceChunk(job.index, ""), False
                if finish:
                    return  # leaving aclosing aborts the engine request if still running
    finally:
        timer.done(finish or FinishReason.ABORT.value)
