"""Engine: one step is schedule -> run model -> sample -> commit to cache -> emit tokens.

Owns: wiring the model runner, allocator, radix cache and scheduler together.
Does not know: HTTP, processes (loop.py drives it in the engine process), text (llm.py, the
offline API, tokenizes around it).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.radix_cache import CacheEvent, RadixCache
from radixserve.cache.tiers.kv_tiers import KVTiers
from radixserve.config import EngineConfig
from radixserve.engine.lora_calls import LoRACalls
from radixserve.engine.model_runner import ModelRunner
from radixserve.engine.overlap import DeviceQueue, InFlight, launch
from radixserve.engine.pin_calls import PinCalls
from radixserve.engine.step_clock import StepClock, event_factory
from radixserve.engine.tiers_setup import build_tiers, pool_medium
from radixserve.grammar.backend import GrammarBackend
from radixserve.grammar.compiler import GrammarCompiler
from radixserve.ipc.messages import (
    CacheCallMsg,
    CallResultMsg,
    GenerateMsg,
    LoadLoRAMsg,
    UnloadLoRAMsg,
)
from radixserve.lora.manager import LoRAManager
from radixserve.model.layers.moe_spec import moe_info
from radixserve.sched.lora_gate import LoRAGate
from radixserve.sched.req import Batch
from radixserve.sched.scheduler import Scheduler
from radixserve.types import Phase, TokenOutput

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.005  # an engine with nothing to run but grammars compiling sleeps this long
MAX_TIMINGS = 4096  # requests whose step timings are kept (oldest dropped first)


@dataclass
class RequestTiming:
    """What the engine measured for one request: its prompt's compute and its tier load."""

    prefill_seconds: float = 0.0  # its share of the steps that computed its prompt
    prefill_tokens: int = 0
    load_seconds: float = 0.0  # the tier load that brought its prefix into the pool
    load_tokens: int = 0


@dataclass(frozen=True)
class PrefillSample:
    """A prefill step's shape, for the timing its device time is booked against."""

    num_tokens: int
    mean_pos: float  # the mean position of its new tokens
    prefills: tuple[tuple[str, int], ...]  # (rid, new prompt tokens) of its prefill entries


def _grammar_backend(hf_dir: Path, vocab_size: int, eos_ids: tuple[int, ...],
                     allow_additional_properties: bool = False) -> GrammarBackend:
    from radixserve.tokenizer import load_tokenizer

    return GrammarBackend(load_tokenizer(hf_dir), vocab_size, eos_ids,
                          allow_additional_properties)


class Engine:
    def __init__(self, cfg: EngineConfig, show_progress: bool = True) -> None:
        self.cfg = cfg
        self.runner = ModelRunner(cfg, show_progress)
        pool = self.runner.pool
        self.allocator = PageAllocator(pool.size.num_pages, pool.size.page_size)
        self._events: list[Any] = []  # CacheEvents, and the tiers' block events
        quota = cfg.tenant_cache_quota
        self.tiers: KVTiers | None = build_tiers(cfg, self.runner)
        self.cache = RadixCache(
            pool.size.page_size, disabled=cfg.disable_radix_cache,
            on_event=self._events.append if cfg.enable_kv_events else None,
            eviction_policy=cfg.eviction_policy,
            tenant_quota_tokens=None if quota is None else int(quota * pool.size.num_slots),
            tiers=self.tiers, pool_medium=pool_medium(self.runner.device))
        r = self.runner
        # Grammars compile on a worker thread; the tokenizer's grammar view is built there too,
        # on the first constrained request.
        self.grammars = GrammarCompiler(functools.partial(
            _grammar_backend, r.resolved.hf_dir, r.spec.vocab_size, r.eos_token_ids,
            cfg.structured_outputs_allow_additional_properties))
        # LoRA adapters: read off the step by the manager's worker thread.
        self.lora = None if cfg.lora is None else LoRAManager(cfg.lora, r.spec, r.dtype,
                                                              r.device)
        gate = None if self.lora is None or cfg.lora is None else LoRAGate(
            self.lora, cfg.lora.max_loras)
        self.scheduler = Scheduler(cfg, self.allocator, self.cache, r.max_model_len,
                                   r.spec.vocab_size, r.eos_token_ids, self.grammars,
                                   self.tiers, cfg.speculative_config, gate)
        self.lora_calls = LoRACalls(self.lora)
        self.timings: dict[str, RequestTiming] = {}  # rid -> its engine timings
        if self.scheduler.tier_loads is not None:
            self.scheduler.tier_loads.on_load = self._note_load
        self.pin_calls = PinCalls(self.scheduler, cfg.disable_radix_cache)
        self.clock: StepClock[PrefillSample] = StepClock(event_factory(r.device))
        # Overlap scheduling: on where the device runs asynchronously (CUDA, or a simulated
        # device on CPU), unless --disable-overlap-schedule; tensor parallelism waits for
        # its collectives every step, so it runs without.
        self.overlap = not cfg.disable_overlap_schedule and r.tp_lead is None and (
            r.device.type == "cuda" or cfg.overlap_on_cpu)
        self.device_queue: DeviceQueue | None = None  # a simulated device (bench, tests)
        self.inflight: InFlight | None = None  # the overlapped step launched, not processed
        self.num_overlapped_steps = 0  # launched before the step before was processed

    @property
    def info(self) -> dict[str, Any]:
        r = self.runner
        return {
            "model": r.resolved.name, "model_path": str(r.resolved.hf_dir),
            "architecture": r.spec.architecture, "max_model_len": r.max_model_len,
            "kv_cache_tokens": r.pool.size.num_slots, "page_size": r.pool.size.page_size,
            "kv_cache_dtype": r.kv_cache_dtype, "kv_cache_bytes": r.pool.num_bytes,
            "kv_cache_storage_dtype": str(r.pool.dtype).removeprefix("torch."),
            "kv_cache_scales": r.kv_scale_source,
            "max_concurrency": r.pool.size.num_slots / r.max_model_len,
            "dtype": str(r.dtype).removeprefix("torch."), "device": str(r.device),
            "quantization": r.quantization,
            "linear_weight_bytes": sum(r.model.linear_weight_bytes()),
            "eos_token_ids": list(r.eos_token_ids), "attention_backend": r.backend_name,
            "cpu_kernels": r.cpu_kernels,
            "weight_huge_pages": None if r.weight_pages is None else r.weight_pages.info(),
            "disable_radix_cache": self.cfg.disable_radix_cache,
            "schedule_policy": self.cfg.schedule_policy.value,
            "chunked_prefill_size": self.cfg.chunked_prefill_size,
            "max_running_requests": self.cfg.max_running_requests,
            "vocab_size": r.spec.vocab_size,
            "speculative_config": (None if self.cfg.speculative_config is None
                                   else dataclasses.asdict(self.cfg.speculative_config)),
            "kv_offload": None if self.tiers is None else self.tiers.describe(),
            "tensor_parallel_size": self.cfg.tensor_parallel_size,
            "tp_worker_pids": [] if r.tp_lead is None else r.tp_lead.pids,
            "moe": moe_info(r.spec, self.cfg.tensor_parallel_size,
                            self.cfg.enable_expert_parallel),
            "enable_lora": self.lora is not None,
        }

    def add_request(self, msg: GenerateMsg) -> None:
        if msg.lora_name is not None and msg.lora_path and self.lora is not None:
            self.lora.register(msg.lora_name, msg.lora_path)  # an offline LoRARequest
        self.scheduler.add(msg.rid, msg.prompt_ids, msg.params, msg.cache_salt, msg.priority,
                           msg.prediction_ids, msg.lora_name)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def has_work(self) -> bool:
        return (self.inflight is not None or self.scheduler.has_work()
                or self.lora_calls.busy())

    def step(self) -> list[TokenOutput]:
        if self.inflight is not None:
            outputs = self._step_overlapped(self.inflight)
            return self._end_step(outputs)
        batch = self.scheduler.schedule()
        if batch is not None and self.overlap and batch.rows is not None and (
                batch.rows.overlap_ok):
            # The first step of an overlapped run: launched, its tokens read next step.
            self.inflight = launch(self.runner, batch, None, self.device_queue)
            self.scheduler.advance(batch)
            return self._end_step(self.scheduler.drain_aborted())
        if batch is None:
            if self.scheduler.waiting_on_grammars():
                self.grammars.wait_any(GRAMMAR_WAIT_S)
            elif self.scheduler.waiting_on_loads():
                loads = self.scheduler.tier_loads
                assert loads is not None
                loads.wait_any(GRAMMAR_WAIT_S)
            elif self.lora is not None and self.lora.busy():
                self.lora.wait_any(GRAMMAR_WAIT_S)  # adapters loading, nothing else to run
            outputs = self.scheduler.drain_aborted()
        else:
            t0 = time.perf_counter()
            # The tiers' prefill cost model reads the device's time (CUDA events), not the
            # host's: a CUDA chunk that samples nothing returns before the GPU finished.
            sample = self._prefill_sample(batch)
            start = self.clock.start() if sample is not None else None
            result = self.runner.run(batch)
            if self.device_queue is not None:  # as reading the tokens syncs a CUDA stream
                self.device_queue.record().result()
            if start is not None and sample is not None:
                self.clock.stop(start, sample)
            outputs = self.scheduler.process_outputs(batch, result.token_ids, result.logprobs)
            self.scheduler.spec.observe_step(batch, outputs, time.perf_counter() - t0)
        for sample, seconds in self.clock.done():
            self._note_prefill(sample, seconds)
        return self._end_step(outputs)

    def _step_overlapped(self, prev: InFlight) -> list[TokenOutput]:
        """Plan and launch the next decode step while `prev` runs, then process `prev`'s
        tokens (engine/overlap.py); without a step to overlap, only `prev`'s."""
        nxt = None
        if self.scheduler.overlappable():
            batch = self.scheduler.schedule()
            assert batch is not None and batch.rows is not None, "a plain decode"
            nxt = launch(self.runner, batch, prev, self.device_queue)
            self.scheduler.advance(batch)
            self.num_overlapped_steps += 1
        self.inflight = nxt
        return self.scheduler.process_outputs(prev.batch, prev.token_ids(), None,
                                              advanced=True)

    def _end_step(self, outputs: list[TokenOutput]) -> list[TokenOutput]:
        outputs = self.pin_calls.client_outputs(outputs)
        self.lora_calls.poll()
        if self.tiers is not None:
            self.tiers.end_step()  # the step's tier work joins the step-wait histogram
        return outputs

    def flush_cache(self, include_pins: bool = False) -> bool:
        return self.scheduler.flush_cache(include_pins)

    def _prefill_sample(self, batch: Batch) -> PrefillSample | None:
        """What a prefill step's timing will be booked against (read before the step's
        outputs move the requests on); None when nothing reads it."""
        if self.tiers is None or batch.phase is Phase.DECODE:
            return None  # tiers off: nothing reads the timings, so a step pays nothing for them
        # The prefill cost model's sample: the step's tokens and their mean position.
        pos = sum(e.num_new_tokens * (e.req.num_computed_tokens + e.num_new_tokens / 2)
                  for e in batch.entries)
        prefills = tuple((e.req.rid, e.num_new_tokens) for i, e in enumerate(batch.entries)
                         if batch.is_prefill(i))
        return PrefillSample(batch.num_tokens, pos / batch.num_tokens, prefills)

    def _note_prefill(self, sample: PrefillSample, seconds: float) -> None:
        """The engine's own prefill timings: the tiers' prefill rate, and per request the
        seconds of the steps that computed its prompt (a step's time shared by tokens)."""
        if self.tiers is None:
            return
        self.tiers.note_prefill(sample.num_tokens, sample.mean_pos, seconds)
        for rid, n in sample.prefills:
            t = self.timings.setdefault(rid, RequestTiming())
            t.prefill_seconds += seconds * n / sample.num_tokens
            t.prefill_tokens += n
        while len(self.timings) > MAX_TIMINGS:
            del self.timings[next(iter(self.timings))]

    def _note_load(self, rid: str, seconds: float, num_tokens: int) -> None:
        t = self.timings.setdefault(rid, RequestTiming())
        t.load_seconds += seconds
        t.load_tokens += num_tokens

    def close(self) -> None:
        """Stop the tier threads and the tensor-parallel workers; with write-back, first write the pool's blocks to the local
        tier so that the next process starts warm (write-through already did), within
        --kv-offload-shutdown-timeout; what is not written by then is logged."""
        while self.inflight is not None:  # its tokens are read and its request finished
            self.step()
        if self.device_queue is not None:
            self.device_queue.close()
        if self.tiers is not None:
            self.tiers.persist(self.cache, self.cfg.kv_offload_shutdown_timeout)
            self.tiers.close()
            self.tiers = None
        self.runner.close()  # the tensor-parallel workers, if any
        if self.lora is not None:
            self.lora.close()

    # ---- pinned prefixes (the calls of /cache/pin): engine/pin_calls.py answers them ----

    def call(self, msg: CacheCallMsg) -> None:
        if isinstance(msg, (LoadLoRAMsg, UnloadLoRAMsg)):
            self.lora_calls.call(msg)
        else:
            self.pin_calls.call(msg)

    def drain_replies(self) -> list[CallResultMsg]:
        return self.pin_calls.drain_replies() + self.lora_calls.drain_replies()

    def drain_cache_events(self) -> list[CacheEvent]:
        if self.tiers is not None and self.cfg.enable_kv_events:
            self._events.extend(self.tiers.take_events())
        events, self._events[:] = list(self._events), []
        return events

    def stats(self) -> dict[str, Any]:
        stats = dict(self.scheduler.stats())
        # Static, but /metrics renders only the stats snapshot: the pool's format and size.
        stats["kv_cache_dtype"] = self.runner.kv_cache_dtype
        stats["kv_cache_bytes"] = self.runner.pool.num_bytes
        stats.update(self.runner.tp_stats())  # raises once a tensor-parallel rank died
        if self.tiers is not None:
            stats["kv_offload"] = {**self.tiers.stats(),
                                   "tree_tokens": {t.value: n for t, n in
                                                   self.cache.tier_tokens.items()}}
        return stats

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
