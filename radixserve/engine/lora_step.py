"""A step's LoRA inputs: the batch's adapter segments, and on CUDA the kernels' device stacks.

Owns: building LoRABatch from a batch's requests (each request's rows under its adapter, in
row order; consecutive rows of one adapter one segment) and the LoRASlots of a CUDA runner.
Does not know: the scheduler's rules (it keeps one adapter's requests contiguous and at most
--max-loras adapters in a batch), files.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.config import EngineConfig
from radixserve.lora.peft_format import TARGETS, target_parts
from radixserve.model.arch import ModelArch
from radixserve.model.lora_delta import LoRABatch
from radixserve.model.lora_slots import LoRASlots
from radixserve.sched.req import Req


def lora_slots(cfg: EngineConfig, spec: ModelArch, dtype: torch.dtype, device: torch.device
               ) -> LoRASlots | None:
    """The device stacks on CUDA (None on CPU, where the deltas are per-segment GEMMs)."""
    if cfg.lora is None or device.type != "cuda":
        return None
    shapes = {}
    for t in TARGETS:
        (k, n), parts = target_parts(spec, t)
        shapes[t] = (k, n, len(parts) * cfg.lora.max_lora_rank)
    return LoRASlots(cfg.lora.max_loras, shapes, spec.num_layers, dtype, device)


def lora_batch(reqs: Sequence[Req], num_tokens: Sequence[int], total: int, decode: bool,
               slots: LoRASlots | None) -> LoRABatch | None:
    """The step's adapter segments (None: every row is the base model's). `num_tokens`: each
    request's rows; `total`: their sum; `decode`: one row each (the kernels' BGMV form)."""
    if all(r.lora is None for r in reqs):
        return None
    batch = LoRABatch.from_runs([(None if r.lora is None else r.lora.layers, n)
                                 for r, n in zip(reqs, num_tokens, strict=True)])
    if batch is None or slots is None:
        return batch
    return batch.on_slots(slots, total, decode)
