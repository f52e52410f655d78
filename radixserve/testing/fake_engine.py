"""Test double for the engine: FakeEngine (the Engine contract, no model) and InlineTransport.

Owns: a deterministic engine that "generates" by echoing its prompt (so tests can predict
text, stop strings and UTF-8 splits), with real-looking KV accounting and prefix-cache hits;
and a transport that runs an EngineLoop as an asyncio task in the same process.
Does not know: HTTP. Used by tests and bench/http_overhead.py; `radixserve serve` has no way
to load it (the engine process builds the real Engine unless a test passes a factory).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.cache.radix_cache import CacheEvent, CacheEventKind
from radixserve.config import EngineConfig
from radixserve.engine.loop import EngineLike, EngineLoop
from radixserve.ipc.messages import (
    CacheCallMsg,
    CallResultMsg,
    EngineErrorMsg,
    EngineReadyMsg,
    GenerateMsg,
)
from radixserve.types import FinishReason, InvalidRequestError, TokenLogprobs, TokenOutput


@dataclass
class _FakeReq:
    msg: GenerateMsg
    max_new: int
    offset: int  # where in the prompt the echo starts (seeded when sampling)
    num_cached: int
    output_ids: list[int]
    aborted: bool = False


class FakeEngine:
    """Echoes the prompt back, one token per running request per step.

    Output token k of a request is prompt_ids[(offset + k) % len(prompt)], offset 0 when greedy
    and drawn from Random(seed) otherwise. EOS / stop_token_ids / max_tokens / min_tokens /
    ignore_eos behave as in the real engine. `fail_at_step` makes step() raise (crash tests);
    `start_delay` makes construction slow and `start_error` makes it fail (start-up tests).
    `max_running` caps the requests that run at once: the rest wait, in arrival order, holding
    no KV and producing nothing (queueing tests).
    """

    def __init__(self, cfg: EngineConfig, *, step_delay: float = 0.0,
                 eos_token_ids: tuple[int, ...] = (), max_model_len: int = 512,
                 kv_cache_tokens: int = 8192, fail_at_step: int | None = None,
                 start_delay: float = 0.0, start_error: str | None = None,
                 max_running: int | None = None) -> None:
        time.sleep(start_delay)  # a model that takes a while to load
        if start_error is not None:
            raise RuntimeError(start_error)
        self.cfg = cfg
        self.max_model_len = cfg.max_model_len or max_model_len
        self.kv_total = cfg.kv_cache_tokens or kv_cache_tokens
        self.eos_token_ids = eos_token_ids
        self._step_delay = step_delay
        self._fail_at_step = fail_at_step
        self._max_running = max_running
        self._num_steps = 0
        self._running: dict[str, _FakeReq] = {}
        self._cached: dict[str, list[tuple[int, ...]]] = {}  # salt -> cached sequences
        self._events: list[CacheEvent] = []
        self._replies: list[CallResultMsg] = []
        self._counters = dict.fromkeys(
            ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
             "generation_tokens", "num_aborted_requests"), 0)
        self.info = {
            "model": Path(cfg.model).name, "model_path": cfg.model,
            "max_model_len": self.max_model_len,
            "kv_cache_tokens": self.kv_total, "page_size": cfg.page_size,
            "max_concurrency": self.kv_total / self.max_model_len, "dtype": "float32",
            "device": "cpu", "eos_token_ids": list(eos_token_ids), "attention_backend": "fake",
        }

    def _match(self, prompt: tuple[int, ...], salt: str) -> int:
        best = 0
        for seq in self._cached.get(salt, ()):
            n = 0
            for a, b in zip(seq, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1)  # the last prompt token is always computed

    def add_request(self, msg: GenerateMsg) -> None:
        num_prompt = len(msg.prompt_ids)
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens; the context is {self.max_model_len}",
                param="prompt")
        room = self.max_model_len - num_prompt
        max_new = room if msg.params.max_tokens is None else msg.params.max_tokens
        if max_new > room:
            raise InvalidRequestError(
                f"prompt ({num_prompt}) + max_tokens ({max_new}) exceeds the context "
                f"({self.max_model_len})", param="max_tokens")
        offset = 0
        if not msg.params.greedy:
            offset = random.Random(msg.params.seed).randrange(num_prompt)
        num_cached = self._match(tuple(msg.prompt_ids), msg.cache_salt)
        self._counters["prefix_cache_queries"] += num_prompt
        self._counters["prefix_cache_hits"] += num_cached
        self._counters["prompt_tokens"] += num_prompt
        self._running[msg.rid] = _FakeReq(msg, max_new, offset, num_cached, [])

    def abort(self, rid: str) -> None:
        req = self._running.get(rid)
        if req is not None and not req.aborted:
            req.aborted = True
            self._counters["num_aborted_requests"] += 1

    def has_work(self) -> bool:
        return bool(self._running)

    def _next(self, req: _FakeReq) -> TokenOutput:
        prompt, params = req.msg.prompt_ids, req.msg.params
        token = prompt[(req.offset + len(req.output_ids)) % len(prompt)]
        req.output_ids.append(token)
        n = len(req.output_ids)
        reason = None
        if token in params.stop_token_ids or (
            token in self.eos_token_ids and not params.ignore_eos and n > params.min_tokens
        ):
            reason = FinishReason.STOP
        elif n >= req.max_new:
            reason = FinishReason.LENGTH
        logprobs = None
        if params.logprobs is not None:
            top = ((token, -0.25), (token ^ 1, -2.0))[: params.logprobs]
            logprobs = TokenLogprobs(-0.25, top)
        return TokenOutput(req.msg.rid, token, reason, len(prompt), req.num_cached, logprobs)

    def _active(self) -> list[_FakeReq]:
        """The requests that run this step: the first `max_running` not aborted."""
        live = [r for r in self._running.values() if not r.aborted]
        return live if self._max_running is None else live[: self._max_running]

    def step(self) -> list[TokenOutput]:
        self._num_steps += 1
        if self._fail_at_step is not None and self._num_steps >= self._fail_at_step:
            raise RuntimeError("fake engine crash")
        if self._step_delay:
            time.sleep(self._step_delay)
        outputs = []
        active = {id(r) for r in self._active()}
        for req in list(self._running.values()):
            if req.aborted:
                out = TokenOutput(req.msg.rid, None, FinishReason.ABORT, len(req.msg.prompt_ids),
                                  req.num_cached)
            elif id(req) in active:
                out = self._next(req)
                self._counters["generation_tokens"] += 1
            else:
                continue  # waiting for a running slot
            outputs.append(out)
            if out.finish_reason is not None:
                del self._running[req.msg.rid]
                seq = tuple(req.msg.prompt_ids) + tuple(req.output_ids)
                self._cached.setdefault(req.msg.cache_salt, []).append(seq)
                if self.cfg.enable_kv_events:
                    self._events.append(CacheEvent(CacheEventKind.STORED, seq, req.num_cached,
                                                   req.msg.cache_salt))
        return outputs

    def call(self, msg: CacheCallMsg) -> None:
        self._replies.append(CallResultMsg(msg.call_id, error="the fake engine has no pins",
                                           status=501))

    def drain_replies(self) -> list[CallResultMsg]:
        replies, self._replies = self._replies, []
        return replies

    def flush_cache(self, include_pins: bool = False) -> bool:
        if self._running:
            return False
        self._cached.clear()
        if self.cfg.enable_kv_events:
            self._events.append(CacheEvent(CacheEventKind.CLEARED, (), 0, ""))
        return True

    def stats(self) -> dict[str, Any]:
        active = self._active()
        held = sum(len(r.msg.prompt_ids) + len(r.output_ids) for r in active)
        cached = min(sum(len(s) for seqs in self._cached.values() for s in seqs),
                     self.kv_total - held)
        return {
            "num_running": len(active),
            "num_waiting": sum(not r.aborted for r in self._running.values()) - len(active),
            "kv_free_tokens": self.kv_total - held - cached, "kv_cached_tokens": cached,
            "kv_held_tokens": held, "kv_total_tokens": self.kv_total, **self._counters,
        }

    def check_integrity(self) -> None:
        held = sum(len(r.msg.prompt_ids) + len(r.output_ids) for r in self._active())
        assert 0 <= held <= self.kv_total, f"held {held} of {self.kv_total}"

    def drain_cache_events(self) -> list[Any]:
        events, self._events = self._events, []
        return events


class InlineTransport:
    """Runs an EngineLoop as a task on the caller's event loop (tests only: a real engine step
    would block the loop). `step_interval` paces steps so streams interleave like a real engine."""

    def __init__(self, factory: Callable[[EngineConfig], EngineLike], cfg: EngineConfig,
                 step_interval: float = 0.0) -> None:
        self._factory = factory
        self._cfg = cfg
        self._step_interval = step_interval
        self._inbox: deque[Any] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self, on_message: Callable[[Any], None], on_exit: Callable[[str], None]) -> None:
        engine = self._factory(self._cfg)
        on_message(EngineReadyMsg(dict(engine.info)))
        self._task = asyncio.get_running_loop().create_task(
            self._run(EngineLoop(engine, on_message), on_message, on_exit))

    async def _run(self, loop: EngineLoop, on_message: Callable[[Any], None],
                   on_exit: Callable[[str], None]) -> None:
        try:
            while True:
                while self._inbox:
                    if not loop.handle(self._inbox.popleft()):
                        return
                if loop.engine.has_work():
                    loop.step()
                    if not loop.engine.has_work():
                        loop.check_when_idle()
                    loop.send_stats(force=not loop.engine.has_work())
                    await asyncio.sleep(self._step_interval)
                else:
                    self._wakeup.clear()
                    await self._wakeup.wait()
        except Exception as err:  # noqa: BLE001 - mirror the process: report, then exit
            on_message(EngineErrorMsg(f"engine failed: {err}"))
        finally:
            on_exit("the inline engine stopped")

    def send(self, msg: Any) -> None:
        self._inbox.append(msg)
        self._wakeup.set()

    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def close(self, timeout: float) -> None:
        if self._task is None:
            return
        self._task.cancel()
        try:
            await asyncio.wait_for(self._task, timeout)
        except asyncio.CancelledError:
            pass
