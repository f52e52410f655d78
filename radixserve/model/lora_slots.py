"""LoRASlots: device-resident stacks of the adapters a step uses, for the Triton kernels.

Owns: per (layer, fused target) one A stack (S, R_max, in) and one B stack (S, out, R_max),
zero-padded (a rank below R_max or a target an adapter leaves out adds zeros), which adapter
sits in which of the S = `--max-loras` slots (least recently used replaced; the scheduler
admits at most S adapters per batch, so a step's adapters always fit), and a step's segment
tables in the kernels' int32 form. Fixed shapes: what a CUDA graph would read stays put.
Does not know: files, requests, the scheduler; CPU steps never use it (lora_delta.py's GEMMs).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from radixserve.model.lora_delta import AdapterLayers


class LoRASlots:
    def __init__(self, num_slots: int, shapes: dict[str, tuple[int, int, int]],
                 num_layers: int, dtype: torch.dtype, device: torch.device) -> None:
        """`shapes`: target -> (in, out, packed rank bound: parts * --max-lora-rank)."""
        self.num_slots = num_slots
        self.a = [{t: torch.zeros(num_slots, r, k, dtype=dtype, device=device)
                   for t, (k, _, r) in shapes.items()} for _ in range(num_layers)]
        self.b = [{t: torch.zeros(num_slots, n, r, dtype=dtype, device=device)
                   for t, (_, n, r) in shapes.items()} for _ in range(num_layers)]
        self._where: OrderedDict[int, int] = OrderedDict()  # id(adapter layers) -> slot
        self._held: list[AdapterLayers | None] = [None] * num_slots  # keeps ids unique
        self.device = device

    def slots_for(self, adapters: Sequence[AdapterLayers]) -> list[int]:
        """The slot of each adapter (distinct, at most num_slots), copying in the missing."""
        assert len({id(x) for x in adapters}) <= self.num_slots, "more adapters than slots"
        wanted = {id(x) for x in adapters}
        out = []
        for layers in adapters:
            key = id(layers)
            if key in self._where:
                self._where.move_to_end(key)
            else:
                free = [s for s in range(self.num_slots) if s not in self._where.values()]
                if free:
                    slot = free[0]
                else:  # the least recently used slot no adapter of this step holds
                    old = next(k for k in self._where if k not in wanted)
                    slot = self._where.pop(old)
                self._write(slot, layers)
                self._where[key] = slot
            out.append(self._where[key])
        return out

    def _write(self, slot: int, layers: AdapterLayers) -> None:
        self._held[slot] = layers
        for i, lay in enumerate(layers):
            for t, a_stack in self.a[i].items():
                a_stack[slot].zero_()
                self.b[i][t][slot].zero_()
                w = lay.get(t)
                if w is not None:
                    r = w.a.shape[0]
                    a_stack[slot, :r].copy_(w.a)  # (r, in)
                    self.b[i][t][slot, :, :r].copy_(w.b)  # (out, r)
