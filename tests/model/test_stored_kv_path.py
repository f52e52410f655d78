"""The CPU loop's stored path (families/base.py: each layer's RoPE and K/V store as
norm_rope's native rope_store, then the torch backend's attend) against the order it replaces
(rope_qk, then backend.forward, which stores): the same logits and pool bytes bit for bit, in
fp32 and bf16, over a ragged prefill with a long chunk and decode steps; and which forwards
take it (not an 8-bit pool, not a backend without attend())."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.attention.base import AttentionMetadata
from radixserve.attention.cpu_kernels import load_paged_decode, load_prefill_attention
from radixserve.attention.kv_quant import KVScale
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.attention.varlen import MIN_VARLEN_TOKENS
from radixserve.model.families.base import CausalLM
from radixserve.model.families.registry import load_model, read_model_spec
from radixserve.types import Phase
from tests.family_models import make_family_model
from tests.model.test_parity import random_prompts

CPU = torch.device("cpu")
MAX_LEN = 80  # slot-table columns per request
PROMPT_LENS = [5, MIN_VARLEN_TOKENS + 3, 1]  # ragged; the second a long chunk (varlen path)
STEPS = 3


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """QK-norm and one KV head per two query heads' group (tests/family_models.py)."""
    return make_family_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


def step_meta(phase: Phase, prefix_lens: list[int], extend_lens: list[int],
              table: torch.Tensor) -> AttentionMetadata:
    """Request b owns slots b * MAX_LEN + position (its table row b)."""
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    cu = [0]
    for n in extend_lens:
        cu.append(cu[-1] + n)
    out_slots = [b * MAX_LEN + p for b, (s, n) in enumerate(zip(prefix_lens, extend_lens,
                                                                strict=True))
                 for p in range(s, s + n)]
    rows = list(range(len(prefix_lens)))
    i32 = torch.int32
    return AttentionMetadata(
        phase=phase, slot_table=table, rows=torch.tensor(rows),
        prefix_lens=torch.tensor(prefix_lens, dtype=i32),
        extend_lens=torch.tensor(extend_lens, dtype=i32),
        seq_lens=torch.tensor(seq_lens, dtype=i32), cu_extend=torch.tensor(cu, dtype=i32),
        out_slots=torch.tensor(out_slots), prefix_lens_cpu=tuple(prefix_lens),
        extend_lens_cpu=tuple(extend_lens), max_seq_len=max(seq_lens),
        max_extend_len=max(extend_lens), rows_cpu=tuple(rows))


def build(model_dir: Path, dtype: torch.dtype) -> CausalLM:
    backend = TorchAttentionBackend(load_paged_decode(), load_prefill_attention())
    return load_model(model_dir, read_model_spec(model_dir), backend, MAX_LEN, dtype, CPU)


def run(model: CausalLM, scales: list[KVScale] | None = None, kv_dtype: torch.dtype | None = None
        ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A prefill of PROMPT_LENS, then STEPS greedy decode steps: (logits, k_cache, v_cache)."""
    spec, prompts = model.spec, random_prompts(PROMPT_LENS, 250, seed=2)
    num = len(prompts)
    shape = (spec.num_layers, num * MAX_LEN, spec.num_kv_heads, spec.head_dim)
    k_cache = torch.zeros(shape, dtype=kv_dtype or model.embed.dtype)
    v_cache = torch.zeros_like(k_cache)
    table = torch.arange(num * MAX_LEN, dtype=torch.int32).view(num, MAX_LEN)
    lens = list(PROMPT_LENS)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for n in lens for i in range(n)])
    last = torch.tensor(lens).cumsum(0) - 1
    meta = step_meta(Phase.PREFILL, [0] * num, lens, table)
    logits = [model.forward(ids, positions, meta, k_cache, v_cache, last, scales)]
    for _ in range(STEPS):
        nxt = logits[-1].argmax(-1)  # (num,)
        meta = step_meta(Phase.DECODE, lens, [1] * num, table)
        logits.append(model.forward(nxt, torch.tensor(lens), meta, k_cache, v_cache,
                                    torch.arange(num), scales))
        lens = [n + 1 for n in lens]
    return logits, k_cache, v_cache


class Calls:
    """Counts the backend's forward() and attend() calls (still calling them)."""

    def __init__(self, backend: Any) -> None:
        self.forward = self.attend = 0
        inner_forward, inner_attend = backend.forward, backend.attend

        def forward(*a: Any, **kw: Any) -> torch.Tensor:
            self.forward += 1
            return inner_forward(*a, **kw)

        def attend(*a: Any, **kw: Any) -> torch.Tensor:
            self.attend += 1
            return inner_attend(*a, **kw)

        backend.forward, backend.attend = forward, attend


@pytest.fixture(params=["tiny_llama", "tiny_qwen2", "qwen3"])  # qwen2: qkv bias
def model_dir(request: pytest.FixtureRequest) -> Iterator[Path]:
    yield request.getfixturevalue(request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_path_equals_the_backend_store_bit_for_bit(model_dir: Path,
                                                          dtype: torch.dtype) -> None:
    model = build(model_dir, dtype)
    assert model.rope_store is not None, "the native ops build where the tests run"
    calls = Calls(model.backend)
    stored = run(model)
    layers = model.spec.num_layers
    assert (calls.forward, calls.attend) == (0, layers * (1 + STEPS))
    model.rope_store = None  # the order before: rope_qk, then backend.forward stores
    unstored = run(model)
    assert calls.forward == layers * (1 + STEPS)
    for got, want in zip(stored[0], unstored[0], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(stored[1], unstored[1]) and torch.equal(stored[2], unstored[2])


def test_an_8bit_pool_keeps_the_backend_store(tiny_llama: Path) -> None:
    model = build(tiny_llama, torch.float32)
    calls = Calls(model.backend)
    spec = model.spec
    ones = KVScale(torch.ones(spec.num_kv_heads), torch.ones(spec.num_kv_heads))
    run(model, [ones] * spec.num_layers, torch.float8_e4m3fn)
    assert (calls.forward, calls.attend) == (spec.num_layers * (1 + STEPS), 0)
