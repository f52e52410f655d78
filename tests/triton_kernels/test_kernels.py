"""Each Triton kernel against its plain-torch reference over a sparse grid of shapes.

Runs on CUDA when present, else on CPU through Triton's interpreter (slow: the grid covers
each axis once rather than their product; bigger cases are marked slow). Every cache slot
that no request owns, slot 0 included (unused slot-table entries point at it), is NaN, and
outputs are NaN-filled before each launch: reading a slot it must not, or leaving an element
unwritten, shows up as NaN. On CPU, TRITON_INTERPRET=1 must be set before triton is first
imported (see triton_kernels.testing); otherwise these tests fail saying so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import NamedTuple

import pytest
import torch

from triton_kernels import decode_attention, extend_attention, store_kv
from triton_kernels._common import KernelDeviceError, check_launchable
from triton_kernels.aot_check import every_launch
from triton_kernels.reference import decode_attention_ref, extend_attention_ref
from triton_kernels.testing import device_or_error

DEVICE, DEVICE_ERROR = device_or_error()
F32, BF16 = torch.float32, torch.bfloat16
TOL = {F32: 1e-5, BF16: 1e-2}


class Paged(NamedTuple):
    slot_table: torch.Tensor  # (num_rows, max_len) int32; unused entries are 0 (a NaN slot)
    rows: torch.Tensor  # (B,) int64, table rows in shuffled order
    num_slots: int
    used_slots: torch.Tensor  # (sum(lens),) int64


def make_paged(lens: list[int], page_size: int, gen: torch.Generator) -> Paged:
    """Give request b `lens[b]` slots made of whole pages taken in shuffled order."""
    pages_per_req = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per_req) + 3  # page 0 and two more stay unowned (NaN)
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    num_rows, max_len = len(lens) + 2, max(lens) + 5
    table = torch.zeros(num_rows, max_len, dtype=torch.int32)
    rows = torch.randperm(num_rows, generator=gen)[: len(lens)]
    used = []
    for row, n, n_pages in zip(rows.tolist(), lens, pages_per_req, strict=True):
        pages = torch.tensor([order.pop() for _ in range(n_pages)])
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        table[row, :n] = slots.int()
        used.append(slots)
    return Paged(table.to(DEVICE), rows.to(DEVICE), num_pages * page_size,
                 torch.cat(used).long().to(DEVICE))


def make_cache(paged: Paged, kv_heads: int, head_dim: int, dtype: torch.dtype,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (paged.num_slots, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    n = paged.used_slots.shape[0]
    k_cache[paged.used_slots] = randn((n, kv_heads, head_dim), dtype, gen)
    v_cache[paged.used_slots] = randn((n, kv_heads, head_dim), dtype, gen)
    return k_cache, v_cache


def randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=DEVICE)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "NaN/inf in the kernel output"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def upcast(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference runs on fp32 copies: the ground truth of the same (rounded) inputs."""
    return q.float(), k_cache.float(), v_cache.float()


@pytest.fixture
def runnable_kernels() -> None:
    if DEVICE_ERROR:
        pytest.fail(DEVICE_ERROR, pytrace=False)


# --- store_kv ---------------------------------------------------------------------------

@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize(
    ("num_tokens", "kv_heads", "head_dim", "page_size", "dtype"),
    [(1, 1, 64, 1, F32), (37, 2, 128, 16, BF16), (300, 8, 64, 16, F32), (19, 3, 128, 1, BF16)],
)
def test_store_kv_matches_reference(num_tokens: int, kv_heads: int, head_dim: int,
                                    page_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    paged = make_paged([num_tokens], page_size, gen)
    shape = (paged.num_slots, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    # k and v as views into one fused projection output, as the model produces them.
    fused = randn((num_tokens, 3 * kv_heads, head_dim), dtype, gen)
    k, v = fused[:, kv_heads : 2 * kv_heads], fused[:, 2 * kv_heads :]
    store_kv(k_cache, v_cache, k, v, paged.used_slots)
    assert torch.equal(k_cache[paged.used_slots], k)
    assert torch.equal(v_cache[paged.used_slots], v)
    unused = torch.ones(paged.num_slots, dtype=torch.bool, device=DEVICE)
    unused[paged.used_slots] = False
    assert torch.isnan(k_cache[unused]).all() and torch.isnan(v_cache[unused]).all()


@pytest.mark.usefixtures("runnable_kernels")
def test_store_kv_rejects_mismatched_dtype() -> None:
    k_cache = torch.zeros(8, 2, 64, device=DEVICE)
    k = torch.zeros(2, 2, 64, dtype=BF16, device=DEVICE)
    slots = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(AssertionError, match="dtype"):
        store_kv(k_cache, k_cache.clone(), k, k, slots)


def test_compiled_kernel_on_cpu_tensors_is_a_clear_error() -> None:
    with pytest.raises(KernelDeviceError, match="TRITON_INTERPRET"):
        check_launchable(object(), torch.device("cpu"))


# --- decode_attention --------------------------------------------------------------------

DECODE_LENS = [1, 15, 64, 65, 129, 300]  # below, at and past multiples of BLOCK_N and pages
DECODE_CASES = [
    # head_dim, kv_heads, group, page_size, dtype, num_splits
    pytest.param(64, 2, 1, 16, F32, None, id="d64-mha-p16-f32"),
    pytest.param(128, 1, 3, 1, F32, 3, id="d128-g3-p1-f32-s3"),
    pytest.param(64, 1, 8, 1, BF16, 1, id="d64-g8-p1-bf16-s1"),
    pytest.param(128, 2, 3, 16, BF16, 16, id="d128-g3-p16-bf16-s16"),
    pytest.param(128, 2, 8, 16, F32, 5, id="d128-g8-p16-f32-s5", marks=pytest.mark.slow),
    pytest.param(64, 3, 3, 1, BF16, None, id="d64-g3-p1-bf16", marks=pytest.mark.slow),
]


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize(("head_dim", "kv_heads", "group", "page_size", "dtype", "num_splits"),
                         DECODE_CASES)
def test_decode_attention_matches_reference(head_dim: int, kv_heads: int, group: int,
                                            page_size: int, dtype: torch.dtype,
                                            num_splits: int | None) -> None:
    gen = torch.Generator().manual_seed(head_dim + group)
    paged = make_paged(DECODE_LENS, page_size, gen)
    k_cache, v_cache = make_cache(paged, kv_heads, head_dim, dtype, gen)
    q = randn((len(DECODE_LENS), kv_heads * group, head_dim), dtype, gen)
    seq_lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k_cache, v_cache, paged.slot_table, paged.rows, seq_lens, scale,
                     num_splits=num_splits, out=out)
    qf, kf, vf = upcast(q, k_cache, v_cache)
    ref = decode_attention_ref(qf, kf, vf, paged.slot_table, paged.rows, seq_lens, scale)
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.usefixtures("runnable_kernels")
def test_decode_attention_strided_q_and_out() -> None:
    """q a view into a fused qkv buffer; out a view into a wider buffer."""
    gen = torch.Generator().manual_seed(7)
    lens, kv_heads, group, head_dim = [3, 70], 2, 2, 64
    paged = make_paged(lens, 16, gen)
    k_cache, v_cache = make_cache(paged, kv_heads, head_dim, F32, gen)
    q = randn((2, kv_heads * (group + 2), head_dim), F32, gen)[:, : kv_heads * group]
    wide = torch.full((2, kv_heads * group + 1, head_dim), float("nan"), device=DEVICE)
    out = wide[:, 1:]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    decode_attention(q, k_cache, v_cache, paged.slot_table, paged.rows, seq_lens, 0.125, out=out)
    ref = decode_attention_ref(q, k_cache, v_cache, paged.slot_table, paged.rows, seq_lens, 0.125)
    assert rel_err(out, ref) <= 1e-5
    assert torch.isnan(wide[:, 0]).all()


# --- extend_attention --------------------------------------------------------------------

# (prefix_len, extend_len): no prefix, single tokens, block and page boundaries, long prefix.
EXTEND_REQS = [(0, 1), (0, 37), (16, 1), (64, 65), (250, 50), (5, 16)]
EXTEND_CASES = [
    # head_dim, kv_heads, group, page_size, dtype
    pytest.param(64, 2, 1, 1, F32, id="d64-mha-p1-f32"),
    pytest.param(128, 1, 3, 16, F32, id="d128-g3-p16-f32"),
    pytest.param(64, 1, 8, 16, BF16, id="d64-g8-p16-bf16"),
    pytest.param(128, 2, 3, 1, BF16, id="d128-g3-p1-bf16", marks=pytest.mark.slow),
    pytest.param(128, 1, 8, 1, F32, id="d128-g8-p1-f32", marks=pytest.mark.slow),
]


def run_extend(reqs: list[tuple[int, int]], head_dim: int, kv_heads: int, group: int,
               page_size: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """(kernel output, fp32 reference) for one ragged batch."""
    gen = torch.Generator().manual_seed(seed)
    paged = make_paged([p + n for p, n in reqs], page_size, gen)
    k_cache, v_cache = make_cache(paged, kv_heads, head_dim, dtype, gen)
    prefix_lens = torch.tensor([p for p, _ in reqs], dtype=torch.int32, device=DEVICE)
    extend_lens = torch.tensor([n for _, n in reqs], dtype=torch.int32, device=DEVICE)
    cu_extend = torch.zeros(len(reqs) + 1, dtype=torch.int32, device=DEVICE)
    cu_extend[1:] = extend_lens.cumsum(0)
    q = randn((int(extend_lens.sum()), kv_heads * group, head_dim), dtype, gen)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    table, rows = paged.slot_table, paged.rows
    extend_attention(q, k_cache, v_cache, table, rows, prefix_lens, extend_lens, cu_extend,
                     max(n for _, n in reqs), scale, out=out)
    qf, kf, vf = upcast(q, k_cache, v_cache)
    ref = extend_attention_ref(qf, kf, vf, table, rows, prefix_lens, extend_lens, cu_extend, scale)
    return out, ref


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize(("head_dim", "kv_heads", "group", "page_size", "dtype"), EXTEND_CASES)
def test_extend_attention_matches_reference(head_dim: int, kv_heads: int, group: int,
                                            page_size: int, dtype: torch.dtype) -> None:
    out, ref = run_extend(EXTEND_REQS, head_dim, kv_heads, group, page_size, dtype, seed=group)
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.usefixtures("runnable_kernels")
def test_extend_of_one_token_equals_decode() -> None:
    """extend_len == 1 is decode: the two kernels agree on the same batch."""
    gen = torch.Generator().manual_seed(3)
    lens, kv_heads, group, head_dim = [1, 40, 129], 2, 3, 64
    paged = make_paged(lens, 16, gen)
    k_cache, v_cache = make_cache(paged, kv_heads, head_dim, F32, gen)
    q = randn((3, kv_heads * group, head_dim), F32, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ones = torch.ones(3, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(4, dtype=torch.int32, device=DEVICE)
    dec = decode_attention(q, k_cache, v_cache, paged.slot_table, paged.rows, seq_lens, 0.1,
                           num_splits=2)
    ext = extend_attention(q, k_cache, v_cache, paged.slot_table, paged.rows, seq_lens - 1,
                           ones, cu, 1, 0.1)
    assert rel_err(ext, dec) <= 1e-5


# --- compile for real GPUs ---------------------------------------------------------------

@pytest.mark.slow
def test_kernels_compile_for_hopper_without_a_gpu() -> None:
    """The interpreter accepts code the compiler rejects: compile every kernel for sm_90
    (Triton frontend, lowering and ptxas) in a process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "triton_kernels.aot_check", "--arch", "90",
                           "--jobs", "2"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("sm_90 ")]
    assert compiled == [launch.kernel.__name__ for launch, _ in every_launch()], proc.stdout
    # the fused MoE, both quantized GEMMs and the LoRA kernels are among them
    for name in ("_gate_up_kernel", "_down_kernel", "_w4a16_kernel", "_fp8_kernel",
                 "_sgmv_shrink_kernel", "_bgmv_shrink_kernel", "_sgmv_expand_kernel",
                 "_bgmv_expand_kernel"):
        assert name in compiled, name
    assert "moe int4 group=128" in proc.stdout and "moe fp8 group=128" in proc.stdout  # quantized
