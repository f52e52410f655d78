"""Eager-path overheads of the Triton decode path (issue 42, defect 7).

- The split count is a runtime argument: the compiled variant of the decode kernels is the
  same for every batch size (counted by their constexpr keys, on CPU with a fake 132-SM GPU;
  and by Triton's own kernel cache on CUDA).
- `check=False` skips the wrapper's checks (the model's later layers) and the backend asks the
  device's SM count once, not per layer.
- A bucket whose capture raises a Triton error is left to run eagerly; the others are captured.
- The fused MoE's pair count (tokens * top-k) is a runtime argument, unspecialized: its two
  kernels compile one variant for every batch size (counted by Triton's own specialization
  keys, variants.py), and stay exact under the interpreter at each.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

import radixserve.attention.triton_backend as tb
from radixserve.attention.triton_backend import TritonAttentionBackend
from radixserve.engine.cuda_graph import capture_each
from radixserve.engine.graph_inputs import GraphKey, GraphKind
from tests.triton_kernels.test_fused_moe import _case
from tests.triton_kernels.test_kernels import DEVICE, DEVICE_ERROR, make_cache, make_paged, randn
from tests.triton_kernels.variants import VariantRecorder
from triton_kernels.reference import fused_moe_ref

# The package exports the function under the module's name: reach the module itself.
dec = importlib.import_module("triton_kernels.decode_attention")
moe = importlib.import_module("triton_kernels.fused_moe")


class RecordingKernel:
    """Stands in for a @triton.jit kernel: records the constexpr keys of every launch."""

    def __init__(self, keys: set[tuple[Any, ...]]) -> None:
        self.keys = keys

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.keys.add(tuple(sorted((k, v) for k, v in kwargs.items() if k.isupper())))
        return launch


def test_decode_compiles_one_variant_for_every_batch_size(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    split_keys: set[tuple[Any, ...]] = set()
    merge_keys: set[tuple[Any, ...]] = set()
    monkeypatch.setattr(dec, "_decode_split_kernel", RecordingKernel(split_keys))
    monkeypatch.setattr(dec, "_decode_merge_kernel", RecordingKernel(merge_keys))
    monkeypatch.setattr(dec, "check_launchable", lambda kernel, device: None)
    monkeypatch.setattr(tb, "num_sms", lambda device: 132)  # an H100's SM count
    backend = TritonAttentionBackend()
    splits = set()
    for batch in (1, 2, 3, 5, 8, 13, 32, 64, 256):
        q, k, v, meta = _decode_meta(batch)
        backend.attend(q, k, v, meta, 0.125, check=batch == 1)
        splits.add(dec.splits_for(batch, 2, 132))
    assert len(splits) > 1  # the split count follows the batch size ...
    assert len(split_keys) == 1 and len(merge_keys) == 1  # ... one compiled variant each


def test_fused_moe_compiles_one_variant_for_every_batch_size(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    if DEVICE_ERROR:
        pytest.fail(DEVICE_ERROR, pytrace=False)
    recorders = [VariantRecorder(moe._gate_up_kernel), VariantRecorder(moe._down_kernel)]
    monkeypatch.setattr(moe, "_gate_up_kernel", recorders[0])
    monkeypatch.setattr(moe, "_down_kernel", recorders[1])
    monkeypatch.setattr(moe, "check_launchable", lambda kernel, device: None)
    # pair counts 2, 4, 6, 10, 16 (a multiple of 16: Triton's default specializes on it), 26, 48
    for tokens in (1, 2, 3, 5, 8, 13, 24):
        x, w, ids, gate_up, down = _case(tokens, 64, 32, 8, 2, torch.float32, seed=tokens)
        out = moe.fused_moe(x, w, ids, gate_up, down)
        torch.testing.assert_close(out, fused_moe_ref(x, w, ids, gate_up, down),
                                   rtol=1e-5, atol=1e-5)
    assert [len(r.keys) for r in recorders] == [1, 1]


def test_the_sm_count_is_asked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.device] = []
    monkeypatch.setattr(tb, "num_sms", lambda device: calls.append(device) or 132)
    monkeypatch.setattr(dec, "_decode_split_kernel", RecordingKernel(set()))
    monkeypatch.setattr(dec, "_decode_merge_kernel", RecordingKernel(set()))
    monkeypatch.setattr(dec, "check_launchable", lambda kernel, device: None)
    backend = TritonAttentionBackend()
    q, k, v, meta = _decode_meta(4)
    for layer in range(6):
        backend.attend(q, k, v, meta, 0.125, check=layer == 0)
    assert calls == [q.device]


def _decode_meta(batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    from radixserve.attention.base import AttentionMetadata
    from radixserve.types import Phase

    gen = torch.Generator().manual_seed(1)
    lens = [5] * batch
    paged = make_paged(lens, 16, gen)
    k, v = make_cache(paged, 2, 64, torch.float32, gen)
    q = randn((batch, 4, 64), torch.float32, gen)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(
        phase=Phase.DECODE, slot_table=paged.slot_table, rows=paged.rows,
        prefix_lens=seq - 1, extend_lens=torch.ones_like(seq), seq_lens=seq,
        cu_extend=torch.arange(batch + 1, dtype=torch.int32), out_slots=paged.rows,
        prefix_lens_cpu=(4,) * batch, extend_lens_cpu=(1,) * batch, max_seq_len=5,
        max_extend_len=1, rows_cpu=tuple(range(batch)))
    return q, k, v, meta


def test_a_bucket_whose_capture_fails_runs_eagerly_and_the_rest_are_captured() -> None:
    from triton.runtime.errors import OutOfResources

    captured: list[GraphKey] = []

    def capture_one(key: GraphKey) -> None:
        if key.bs == 64:
            raise OutOfResources(232448, 166912, "shared memory")
        captured.append(key)

    keys = [GraphKey(GraphKind.DECODE, bs) for bs in (64, 32, 8, 1)]
    failed = capture_each(keys, capture_one)
    assert list(failed) == [GraphKey(GraphKind.DECODE, 64)]
    assert "OutOfResources" in failed[keys[0]] and captured == keys[1:]


@pytest.mark.gpu
def test_eager_decode_compiles_once_across_batch_sizes_on_cuda() -> None:
    backend = TritonAttentionBackend()
    for batch in (1, 2, 3, 5, 8, 13, 32, 64):
        q, k, v, meta = _decode_meta(batch)
        backend.attend(q, k, v, meta, 0.125)
    cache = getattr(dec._decode_split_kernel, "device_caches", None)
    assert cache is not None
    (kernels, *_), = cache.values()
    assert len(kernels) == 1


@pytest.mark.gpu
def test_eager_fused_moe_compiles_once_across_batch_sizes_on_cuda() -> None:
    dev = torch.device("cuda")
    for tokens in (1, 2, 3, 5, 8, 13, 24):
        moe.fused_moe(*(t.to(dev) for t in _case(tokens, 64, 32, 8, 2, torch.bfloat16)))
    for kernel in (moe._gate_up_kernel, moe._down_kernel):
        (kernels, *_), = kernel.device_caches.values()
        assert len(kernels) == 1
