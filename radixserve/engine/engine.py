"""Engine: one step is schedule -> run model -> sample -> commit to cache -> emit tokens.

Owns: wiring the model runner, allocator, radix cache, slot table and scheduler together.
Does not know: HTTP, processes (loop.py drives it in the engine process), text (llm.py, the
offline API, tokenizes around it).
"""

from __future__ import annotations

import logging
from typing import Any

from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.radix_cache import CacheEvent, RadixCache
from radixserve.cache.req_table import ReqTable
from radixserve.config import EngineConfig
from radixserve.engine.model_runner import ModelRunner
from radixserve.ipc.messages import GenerateMsg
from radixserve.sched.scheduler import Scheduler
from radixserve.types import TokenOutput

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, cfg: EngineConfig, show_progress: bool = True) -> None:
        self.cfg = cfg
        self.runner = ModelRunner(cfg, show_progress)
        pool = self.runner.pool
        self.allocator = PageAllocator(pool.size.num_pages, pool.size.page_size)
        self._events: list[CacheEvent] = []
        quota = cfg.tenant_cache_quota
        self.cache = RadixCache(
            pool.size.page_size, disabled=cfg.disable_radix_cache,
            on_event=self._events.append if cfg.enable_kv_events else None,
            eviction_policy=cfg.eviction_policy,
            tenant_quota_tokens=None if quota is None else int(quota * pool.size.num_slots))
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
            "eos_token_ids": list(r.eos_token_ids), "attention_backend": r.backend_name,
            "disable_radix_cache": self.cfg.disable_radix_cache,
            "schedule_policy": self.cfg.schedule_policy,
            "chunked_prefill_size": self.cfg.chunked_prefill_size,
            "max_running_requests": self.cfg.max_running_requests,
            "vocab_size": r.spec.vocab_size,
        }

    def add_request(self, msg: GenerateMsg) -> None:
        self.scheduler.add(msg.rid, msg.prompt_ids, msg.params, msg.cache_salt, msg.priority)

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
        return self.scheduler.flush_cache()

    def drain_cache_events(self) -> list[CacheEvent]:
        events, self._events[:] = list(self._events), []
        return events

    def stats(self) -> dict[str, Any]:
        return dict(self.scheduler.stats())

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
