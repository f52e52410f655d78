"""The CUDA path of the LoRA deltas (adapters in LoRASlots' device stacks, Triton SGMV/BGMV)
equals the CPU path (one GEMM pair per segment), run here under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from radixserve.lora.peft_format import TARGETS, load_peft_adapter, target_parts
from radixserve.model.families.registry import read_model_spec
from radixserve.model.lora_delta import LoRABatch
from radixserve.model.lora_slots import LoRASlots
from tests.lora.conftest import LoRASet
from triton_kernels.testing import device_or_error

DEVICE, DEVICE_ERROR = device_or_error()


@pytest.mark.parametrize("decode", [False, True])
def test_kernel_deltas_equal_segment_gemms(lora_set: LoRASet, decode: bool) -> None:
    if DEVICE_ERROR:
        pytest.fail(DEVICE_ERROR, pytrace=False)
    spec = read_model_spec(lora_set.base)
    ad = {n: load_peft_adapter(n, p, spec, 8, torch.float32).to(torch.device(DEVICE))
          for n, p in lora_set.adapters.items()}
    shapes = {}
    for t in TARGETS:
        (k, n), parts = target_parts(spec, t)
        shapes[t] = (k, n, len(parts) * 8)
    slots = LoRASlots(2, shapes, spec.num_layers, torch.float32, torch.device(DEVICE))
    g = torch.Generator().manual_seed(0)
    for names in (["alpha", None, "beta"], ["gamma", "alpha"], ["beta", "gamma"]):
        counts = [1] * len(names) if decode else [3, 2, 5][: len(names)]
        runs = [(None if n is None else ad[n].layers, c) for n, c in zip(names, counts, strict=True)]
        cpu = LoRABatch.from_runs(runs)
        assert cpu is not None
        kern = cpu.on_slots(slots, sum(counts), decode)
        for t in TARGETS:
            (k, n), _ = target_parts(spec, t)
            x = torch.randn(sum(counts), k, generator=g).to(DEVICE)
            y = torch.randn(sum(counts), n, generator=g).to(DEVICE)
            want, got = y.clone(), y.clone()
            cpu.add_delta(1, t, x, want)
            kern.add_delta(1, t, x, got)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
