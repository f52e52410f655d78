"""Each tensor-parallel rank binds its own GPU before it touches CUDA (issue 42, defect 3), and a
node with fewer GPUs than ranks is a clear ConfigError (CPU tests with a fake torch.cuda; the
gpu tests run TP 2 where two GPUs exist and skip on one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.config import ConfigError, EngineConfig
from radixserve.engine.model_runner import resolve_device_dtype


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """torch.cuda with two GPUs; records every set_device."""
    bound: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append(torch.device(d)))
    return bound


def test_each_rank_binds_its_local_gpu(fake_gpus: list[torch.device]) -> None:
    cfg = EngineConfig(device="cuda", dtype="float32", tensor_parallel_size=2)
    for rank in (0, 1):
        device, _ = resolve_device_dtype(cfg, local_rank=rank)
        assert device == torch.device("cuda", rank)
    assert fake_gpus == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_more_ranks_than_gpus_is_a_config_error(fake_gpus: list[torch.device]) -> None:
    cfg = EngineConfig(device="cuda", dtype="float32", tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="needs 4 GPUs on this node, found 2"):
        resolve_device_dtype(cfg, local_rank=3)
    assert fake_gpus == []


def test_one_process_on_one_gpu_binds_nothing(fake_gpus: list[torch.device]) -> None:
    resolve_device_dtype(EngineConfig(device="cuda", dtype="float32"))
    assert fake_gpus == []


@pytest.mark.gpu
def test_tp2_on_cuda_equals_tp1_or_is_refused_on_one_gpu(tiny_llama: Path) -> None:
    from radixserve import LLM, SamplingParams

    def make(tp: int) -> LLM:
        return LLM(model=str(tiny_llama), dtype="float32", device="cuda",
                   tensor_parallel_size=tp, kv_cache_tokens=4096)

    if torch.cuda.device_count() < 2:
        with pytest.raises(ConfigError, match="needs 2 GPUs"):
            make(2)
        pytest.skip("one GPU: TP 2 refused clearly (checked above)")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(3, 40)), [5, 6, 7]]
    outs = {}
    for tp in (1, 2):
        llm = make(tp)
        try:
            outs[tp] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.close()
    assert outs[1] == outs[2]
