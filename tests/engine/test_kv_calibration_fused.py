"""fp8 calibration on the fused path (issue 42, defect 2): on CUDA the model runs the fused loop,
which writes K/V inside rope_qk_store and calls backend.attend; the calibration pass must still
see every layer's K/V. On CPU the fused loop runs under Triton's interpreter: its scales must
equal those of the default CPU path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.attention.cpu_kernels import load_paged_decode, load_prefill_attention
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.attention.triton_backend import TritonAttentionBackend
from radixserve.engine.kv_calibration import calibrate
from tests.model.test_fused_forward import CPU, DEVICE, DEVICE_ERROR, build


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn])
def test_calibration_through_the_fused_loop_equals_the_default_path(tiny_llama: Path,
                                                                    fmt: torch.dtype) -> None:
    if DEVICE_ERROR or DEVICE.type != "cpu":
        pytest.skip("the interpreter run (the gpu test of the engine covers CUDA)")
    default = build(tiny_llama, TorchAttentionBackend(load_paged_decode(),
                                                      load_prefill_attention()),
                    torch.float32, CPU)
    fused = build(tiny_llama, TritonAttentionBackend(2), torch.float32, CPU)
    assert fused.fused is not None
    spec = default.spec
    ids = list(range(3, 40))
    want = calibrate(default, ids, fmt, spec.num_kv_heads, spec.head_dim, torch.float32, CPU)
    got = calibrate(fused, ids, fmt, spec.num_kv_heads, spec.head_dim, torch.float32, CPU)
    assert fused.fused is not None and fused.backend.__class__ is TritonAttentionBackend
    torch.testing.assert_close(got.k, want.k, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.v, want.v, rtol=1e-5, atol=0)


@pytest.mark.gpu
def test_fp8_engine_starts_on_cuda_and_serves(tiny_llama: Path) -> None:
    from radixserve import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), dtype="float32", device="cuda", kv_cache_dtype="fp8")
    assert "calibration" in llm.engine.info["kv_cache_scales"]
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8,
                                                      ignore_eos=True))
    assert len(out[0].token_ids) == 8
    llm.close()
