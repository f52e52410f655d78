"""TritonAttentionBackend against the torch backend: one layer directly, then the whole engine.

Runs on CUDA when present, else on CPU through Triton's interpreter (TRITON_INTERPRET=1 must
be set before triton is first imported; see triton_kernels.testing).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from radixserve.attention.base import AttentionBackend, AttentionMetadata
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.attention.triton_backend import TritonAttentionBackend
from radixserve.types import Phase
from tests.tiny_models import make_tiny_model
from triton_kernels.testing import device_or_error

DEVICE, DEVICE_ERROR = device_or_error()


@pytest.fixture
def runnable_kernels() -> None:
    if DEVICE_ERROR:
        pytest.fail(DEVICE_ERROR, pytrace=False)


def make_meta(phase: Phase, prefix_lens: list[int], extend_lens: list[int], rows: list[int],
              slot_table: torch.Tensor, out_slots: torch.Tensor) -> AttentionMetadata:
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    cu = [0]
    for n in extend_lens:
        cu.append(cu[-1] + n)

    def ints(xs: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(xs, dtype=dtype, device=DEVICE)

    return AttentionMetadata(
        phase=phase, slot_table=slot_table, rows=ints(rows, torch.int64),
        prefix_lens=ints(prefix_lens), extend_lens=ints(extend_lens), seq_lens=ints(seq_lens),
        cu_extend=ints(cu), out_slots=out_slots, prefix_lens_cpu=tuple(prefix_lens),
        extend_lens_cpu=tuple(extend_lens), max_seq_len=max(seq_lens),
        max_extend_len=max(extend_lens), rows_cpu=tuple(rows),
    )


@pytest.mark.usefixtures("runnable_kernels")
def test_backend_matches_torch_backend_for_extend_then_decode() -> None:
    """Extend over a cached prefix, then one decode step, through both backends' own pools."""
    gen = torch.Generator().manual_seed(0)
    kv_heads, group, head_dim, num_slots = 2, 3, 64, 512
    prefix_lens, extend_lens, rows = [0, 40, 97], [23, 1, 30], [2, 0, 1]
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    free = (torch.randperm(num_slots - 1, generator=gen)[: sum(seq_lens) + len(rows)] + 1).tolist()
    slot_table = torch.zeros(3, 160, dtype=torch.int32, device=DEVICE)
    for row, n in zip(rows, seq_lens, strict=True):  # + 1 slot for the decode token
        slot_table[row, : n + 1] = torch.tensor([free.pop() for _ in range(n + 1)],
                                                dtype=torch.int32)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(DEVICE)

    # Random everywhere: slots before the prefix length play the cached prefix's KV.
    pool = (rand(num_slots, kv_heads, head_dim), rand(num_slots, kv_heads, head_dim))
    caches = {"torch": pool, "triton": (pool[0].clone(), pool[1].clone())}
    backends: dict[str, AttentionBackend] = {
        "torch": TorchAttentionBackend(), "triton": TritonAttentionBackend(2)}
    steps = [(Phase.PREFILL, prefix_lens, extend_lens),
             (Phase.DECODE, seq_lens, [1, 1, 1])]
    for phase, prefixes, extends in steps:
        out_slots = torch.cat([slot_table[r, p : p + n]
                               for r, p, n in zip(rows, prefixes, extends, strict=True)])
        meta = make_meta(phase, prefixes, extends, rows, slot_table, out_slots.long())
        t = sum(extends)
        q = rand(t, kv_heads * group, head_dim)
        k, v = rand(t, kv_heads, head_dim), rand(t, kv_heads, head_dim)
        outs = {name: backends[name].forward(q, k, v, *caches[name], meta, head_dim**-0.5)
                for name in backends}
        torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-5, atol=1e-5)
        assert torch.equal(caches["triton"][0], caches["torch"][0])
        assert torch.equal(caches["triton"][1], caches["torch"][1])


def test_backend_rejects_bad_split_count() -> None:
    with pytest.raises(ValueError, match="num_kv_splits"):
        TritonAttentionBackend(num_kv_splits=0)


@pytest.fixture(scope="module")
def tiny_llama_hd32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 32, 4 query heads over 2 KV heads.
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama_hd32"), "llama", hidden_size=128)


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_tokens_identical_to_torch_backend(tiny_llama_hd32: Path, page_size: int) -> None:
    from radixserve import LLM, SamplingParams

    rng = random.Random(page_size)
    shared = [rng.randrange(3, 250) for _ in range(90)]  # not a multiple of the page size
    prompts = [shared + [rng.randrange(3, 250) for _ in range(n)] for n in (5, 17, 1, 33)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(tiny_llama_hd32), dtype="float32", attention_backend=backend,
                         kv_cache_tokens=2048, page_size=page_size, device=DEVICE.type)
        first = llm.generate(prompts[:1], params)  # fills the radix cache with the shared part
        second = llm.generate(prompts, params)  # extend attention reads a cached prefix
        assert all(r.num_cached_tokens >= 80 for r in second), "second wave missed the cache"
        results[backend] = [r.token_ids for r in first + second]
    assert all(len(ids) == 8 for ids in results["torch"])
    assert results["triton"] == results["torch"]
