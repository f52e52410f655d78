"""The fused-kernel forward (the layers' Triton path: families/base.py's CausalLM with a
backend that attends over stored K/V) against the unfused ones.

On CPU the fused kernels run under Triton's interpreter on a tiny model (2 layers, hidden 64):
their logits over a prefill and a few decode steps must equal the default CPU path's (torch
backend, native ops, oneDNN linears) and the Triton backend's unfused loop, which proves the
wiring without a GPU. The `gpu` tests compare greedy tokens on CUDA: fused vs unfused, and
HF's own generate in fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.attention.base import AttentionBackend, AttentionMetadata
from radixserve.attention.cpu_kernels import load_paged_decode, load_prefill_attention
from radixserve.attention.kv_quant import KVScale
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.attention.triton_backend import TritonAttentionBackend
from radixserve.engine.kv_calibration import KVScales, calibrate
from radixserve.model.families.base import CausalLM
from radixserve.model.families.registry import load_model, read_model_spec
from radixserve.types import Phase
from tests.model.test_parity import hf_greedy, random_prompts
from triton_kernels.testing import device_or_error

DEVICE, DEVICE_ERROR = device_or_error()
CPU = torch.device("cpu")
MAX_LEN = 64  # slot-table columns per request


@pytest.fixture
def runnable_kernels() -> None:
    if DEVICE_ERROR:
        pytest.fail(DEVICE_ERROR, pytrace=False)


def build(model_dir: Path, backend: AttentionBackend, dtype: torch.dtype, device: torch.device,
          fused: bool | None = None) -> CausalLM:
    return load_model(model_dir, read_model_spec(model_dir), backend, MAX_LEN, dtype, device,
                      fused=fused)


def step_meta(phase: Phase, prefix_lens: list[int], extend_lens: list[int],
              slot_table: torch.Tensor) -> AttentionMetadata:
    """Request b owns slots b * MAX_LEN + position (its table row b, written up front)."""
    dev = slot_table.device
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    cu = [0]
    for n in extend_lens:
        cu.append(cu[-1] + n)
    out_slots = [b * MAX_LEN + p for b, (s, n) in enumerate(zip(prefix_lens, extend_lens,
                                                                strict=True))
                 for p in range(s, s + n)]

    def ints(xs: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(xs, dtype=dtype, device=dev)

    rows = list(range(len(prefix_lens)))
    return AttentionMetadata(
        phase=phase, slot_table=slot_table, rows=ints(rows, torch.int64),
        prefix_lens=ints(prefix_lens), extend_lens=ints(extend_lens), seq_lens=ints(seq_lens),
        cu_extend=ints(cu), out_slots=ints(out_slots, torch.int64),
        prefix_lens_cpu=tuple(prefix_lens), extend_lens_cpu=tuple(extend_lens),
        max_seq_len=max(seq_lens), max_extend_len=max(extend_lens), rows_cpu=tuple(rows))


def greedy(model: CausalLM, prompts: list[list[int]], steps: int,
           kv: tuple[torch.dtype, KVScales] | None = None
           ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill every prompt in one ragged batch, then `steps` decode steps, argmax each time
    (kv: an 8-bit pool's format and scales per layer). Returns (new tokens per prompt, the
    logits of every forward)."""
    spec, dev = model.spec, model.embed.device
    num = len(prompts)
    shape = (spec.num_layers, num * MAX_LEN, spec.num_kv_heads, spec.head_dim)
    k_cache = torch.zeros(shape, dtype=model.embed.dtype if kv is None else kv[0], device=dev)
    v_cache = torch.zeros_like(k_cache)
    scales = None if kv is None else [KVScale(k, v) for k, v in zip(kv[1].k, kv[1].v,
                                                                   strict=True)]
    table = (torch.arange(num * MAX_LEN, dtype=torch.int32, device=dev)).view(num, MAX_LEN)
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p], device=dev)
    positions = torch.tensor([i for n in lens for i in range(n)], device=dev)
    last = torch.tensor(lens, device=dev).cumsum(0) - 1  # each prompt's last row
    meta = step_meta(Phase.PREFILL, [0] * num, lens, table)
    logits = [model.forward(ids, positions, meta, k_cache, v_cache, last, scales)]
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        nxt = logits[-1].argmax(-1)  # (num,)
        for b, t in enumerate(nxt.tolist()):
            out[b].append(t)
        meta = step_meta(Phase.DECODE, lens, [1] * num, table)
        positions = torch.tensor(lens, device=dev)
        rows = torch.arange(num, device=dev)
        logits.append(model.forward(nxt, positions, meta, k_cache, v_cache, rows, scales))
        lens = [n + 1 for n in lens]
    return out, logits


def assert_paths_agree(model_dir: Path, seed: int, fmt: torch.dtype | None) -> None:
    """The default CPU path (torch backend, native ops), the fused loop and the Triton backend's
    unfused loop: the same greedy tokens and logits (fmt: an 8-bit pool of that format, scales
    calibrated on one prompt)."""
    prompts = random_prompts([5, 11, 1], 250, seed=seed)
    default = build(model_dir, TorchAttentionBackend(load_paged_decode(),
                                                     load_prefill_attention()),
                    torch.float32, CPU)
    fused = build(model_dir, TritonAttentionBackend(2), torch.float32, CPU)
    unfused = build(model_dir, TritonAttentionBackend(2), torch.float32, CPU, fused=False)
    assert not default.fused and not unfused.fused and fused.fused
    kv = None
    if fmt is not None:
        spec = default.spec
        kv = (fmt, calibrate(default, prompts[1], fmt, spec.num_kv_heads, spec.head_dim,
                             torch.float32, CPU))
    want_tokens, want = greedy(default, prompts, 3, kv)
    for model in (fused, unfused):
        tokens, got = greedy(model, prompts, 3, kv)
        assert tokens == want_tokens
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"forward {step}")


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])  # qwen2: a qkv bias
def test_fused_forward_on_cpu_matches_the_default_cpu_path(fixture: str,
                                                           request: pytest.FixtureRequest
                                                           ) -> None:
    """hidden 64, 2 layers, 4 query heads over 2 KV heads: head_dim 16 (the kernels' least)."""
    if DEVICE.type != "cpu":
        pytest.skip("the interpreter run; CUDA runs the gpu tests below")
    assert_paths_agree(request.getfixturevalue(fixture), 3, None)


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fused_forward_over_an_8bit_pool_on_cpu(tiny_llama: Path, fmt: torch.dtype) -> None:
    """An 8-bit pool: the fused loop's RoPE + quantizing store writes the bytes the unfused
    store writes, so all three paths agree as above."""
    if DEVICE.type != "cpu":
        pytest.skip("the interpreter run")
    assert_paths_agree(tiny_llama, 4, fmt)


def test_fused_needs_a_backend_that_attends_over_stored_kv(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="attend"):
        build(tiny_llama, TorchAttentionBackend(), torch.float32, CPU, fused=True)


@pytest.mark.gpu
def test_fused_greedy_tokens_equal_unfused_on_cuda(tiny_llama: Path) -> None:
    cuda = torch.device("cuda")
    prompts = random_prompts([3, 17, 40, 9], 250, seed=1)
    runs = {fused: greedy(build(tiny_llama, TritonAttentionBackend(), torch.float32, cuda,
                                fused=fused), prompts, 12)
            for fused in (True, False)}
    assert runs[True][0] == runs[False][0]
    for got, want in zip(runs[True][1], runs[False][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_fused_bf16_prefill_logits_close_to_unfused_on_cuda(tiny_llama: Path) -> None:
    """bf16: the same roundings op by op, but sums in another order: logits, not tokens."""
    cuda = torch.device("cuda")
    prompts = random_prompts([3, 17, 40, 9], 250, seed=2)
    logits = [greedy(build(tiny_llama, TritonAttentionBackend(), torch.bfloat16, cuda,
                           fused=fused), prompts, 0)[1][0] for fused in (True, False)]
    torch.testing.assert_close(logits[0], logits[1], rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
def test_fused_engine_matches_hf_in_fp32_on_cuda(tiny_llama: Path) -> None:
    from radixserve import LLM, SamplingParams

    prompts = random_prompts([1, 7, 33, 130], 250)
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_tokens=8192, device="cuda",
              attention_backend="triton")
    assert llm.engine.runner.model.fused, "CUDA + triton runs the fused kernels"
    ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in ours] == hf_greedy(tiny_llama, prompts, 16)
