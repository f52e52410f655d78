"""Engine: the loop schedule -> run model -> sample -> commit to cache -> emit tokens; and LLM,
the offline API over it.

Owns: wiring the model runner, allocator, radix cache, slot table and scheduler together, and
the run's counters. Does not know: HTTP, processes (engine_proc.py runs it off the loop),
text (LLM decodes with the tokenizer only for convenience).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.radix_cache import CacheEvent, RadixCache
from radixserve.cache.req_table import ReqTable
from radixserve.config import EngineConfig
from radixserve.messages import GenerateMsg
from radixserve.model_runner import ModelRunner
from radixserve.scheduler import Scheduler
from radixserve.types import FinishReason, SamplingParams, TokenLogprobs, TokenOutput

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, cfg: EngineConfig, show_progress: bool = True) -> None:
        self.cfg = cfg
        self.runner = ModelRunner(cfg, show_progress)
        pool = self.runner.pool
        self.allocator = PageAllocator(pool.size.num_pages, pool.size.page_size)
        self._events: list[CacheEvent] = []
        self.cache = RadixCache(pool.size.page_size, disabled=cfg.disable_radix_cache,
                                on_event=self._events.append if cfg.enable_kv_events else None)
        self.scheduler = Scheduler(cfg, self.allocator, self.cache, ReqTable(pool.slot_table),
                                   self.runner.max_model_len, self.runner.spec.vocab_size,
                                   self.runner.eos_token_ids)

    @property
    def info(self) -> dict[str, Any]:
        r = self.runner
        return {
            "model": r.resolved.name, "model_path": str(r.resolved.hf_dir),
            "architecture": r.spec.architecture, "max_model_len": r.max_model_len,
            "kv_cache_tokens": r.pool.size.num_slots, "page_size": r.pool.size.page_size,
            "max_concurrency": r.pool.size.num_slots / r.max_model_len,
            "dtype": str(r.dtype).removeprefix("torch."), "device": str(r.device),
            "quantization": self.cfg.quantization,
            "eos_token_ids": list(r.eos_token_ids), "attention_backend": r.backend_name,
            "disable_radix_cache": self.cfg.disable_radix_cache,
            "schedule_policy": self.cfg.schedule_policy,
            "chunked_prefill_size": self.cfg.chunked_prefill_size,
            "max_running_requests": self.cfg.max_running_requests,
            "vocab_size": r.spec.vocab_size,
        }

    def add_request(self, msg: GenerateMsg) -> None:
        self.scheduler.add(msg.rid, msg.prompt_ids, msg.params, msg.cache_salt)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[TokenOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return self.scheduler.drain_aborted()
        result = self.runner.run(batch)
        return self.scheduler.process_outputs(batch, result.token_ids, result.logprobs)

    def flush_cache(self) -> bool:
        s = self.scheduler
        if s.running or s.prefilling:
            return False
        freed = self.cache.reset()
        if freed:
            self.allocator.free(self.allocator.slots_to_pages(freed))
        return True

    def drain_cache_events(self) -> list[CacheEvent]:
        events, self._events[:] = list(self._events), []
        return events

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        live = s.running + s.prefilling
        total = self.allocator.num_pages * self.allocator.page_size
        return {
            "num_running": len(live), "num_waiting": len(s.waiting),
            "kv_total_tokens": total, "kv_free_tokens": self.allocator.num_free_slots,
            "kv_cached_tokens": self.cache.total_size,
            "kv_evictable_tokens": self.cache.evictable_size,
            "kv_held_tokens": s.mem.held_tokens(live),
            **s.counters,
        }

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


@dataclass
class GenerationResult:
    rid: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    ttft: float = 0.0  # seconds from submission to the first token
    latency: float = 0.0


class LLM:
    """Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str = "smollm2-135m", show_progress: bool = False,
                 **engine_kwargs: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_kwargs), show_progress)
        from radixserve.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(self.engine.runner.resolved.hf_dir)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | Sequence[str] = "",
    ) -> list[GenerationResult]:
        """Submit every prompt at once (one continuous batch) and run until all finish."""
        from radixserve.tokenizer import encode_prompt

        params_list = [params or SamplingParams()] * len(prompts) if not isinstance(
            params, Sequence) else list(params)
        salts: list[str] = ([cache_salt] * len(prompts) if isinstance(cache_salt, str)
                            else list(cache_salt))
        results: dict[str, GenerationResult] = {}
        start = time.perf_counter()
        for prompt, p, salt in zip(prompts, params_list, salts, strict=False):
            ids = (encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str)
                   else [int(t) for t in prompt])  # type: ignore[call-overload]
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(GenerateMsg(rid, ids, p, salt))
            results[rid] = GenerationResult(rid, ids)
        while self.engine.has_work():
            for out in self.engine.step():
                res = results[out.rid]
                now = time.perf_counter() - start
                if out.token_id is not None:
                    if not res.output_ids:
                        res.ttft = now
                    res.output_ids.append(out.token_id)
                    res.num_cached_tokens = out.num_cached_tokens
                if out.logprobs is not None:
                    res.logprobs.append(out.logprobs)
                if out.finish_reason is not None:
                    res.finish_reason, res.latency = out.finish_reason, now
        for res in results.values():
            text = self.tokenizer.decode(res.output_ids, skip_special_tokens=True)
            res.text = text if isinstance(text, str) else "".join(text)
        return list(results.values())

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None
             ) -> GenerationResult:
        from radixserve.tokenizer import encode_chat

        return self.generate([encode_chat(self.tokenizer, messages)], params)[0]

    def kv_stats(self) -> dict[str, Any]:
        return self.engine.stats()
