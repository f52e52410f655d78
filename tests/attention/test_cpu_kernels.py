"""The native CPU attention kernels (paged decode, causal prefill) against their float64
references, their input checks, and the fallback."""

from __future__ import annotations

import logging

import pytest
import torch

from radixserve.attention import cpu_kernels
from radixserve.attention.cpu_kernels import (
    load_paged_decode,
    load_prefill_attention,
    paged_decode_reference,
    prefill_attention_reference,
)
from radixserve.attention.torch_backend import TorchAttentionBackend

# every test under each CPU tier this host executes (tests/conftest.py's cpu_tier)
pytestmark = pytest.mark.usefixtures("cpu_tier")


def kernel() -> cpu_kernels.PagedDecode:
    op = load_paged_decode()
    assert op is not None, "the kernel must build where the tests run (gcc + ninja)"
    return op


def make_inputs(lens: list[int], starts: list[int], hq: int, hkv: int, d: int,
                dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A pool of scattered slots; request b in table row (b * 3) % R, positions < lens[b]."""
    g = torch.Generator().manual_seed(seed)
    B, lmax = len(lens), max(lens) + 5
    num_slots = 3 * B * lmax + 16
    table = torch.randperm(num_slots, generator=g)[: 3 * B * lmax].view(3 * B, lmax).int()
    rows = torch.tensor([(b * 3) % (3 * B) for b in range(B)])
    # the pool as the model holds it: one layer of a (layers, S, Hkv, D) tensor
    k = torch.randn(2, num_slots, hkv, d, generator=g).to(dtype)[1]
    v = torch.randn(2, num_slots, hkv, d, generator=g).to(dtype)[1]
    # q as the model passes it: a strided slice of a wider rotated tensor
    q = torch.randn(B, hq + hkv, d, generator=g).to(dtype)[:, :hq]
    return q, k, v, table, rows, torch.tensor(starts), torch.tensor(lens)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(("hq", "hkv", "d"),
                         [(9, 3, 64), (4, 4, 32), (8, 1, 16), (6, 2, 24), (32, 8, 128), (28, 4, 128)])
def test_kernel_matches_reference(dtype: torch.dtype, tol: float, hq: int, hkv: int,
                                  d: int) -> None:
    lens, starts = [1, 2, 17, 300, 541, 64], [0, 1, 0, 64, 0, 63]
    args = make_inputs(lens, starts, hq, hkv, d, dtype)
    out, lse = kernel()(*args, d**-0.5)
    ref_out, ref_lse = paged_decode_reference(*args, d**-0.5)
    assert out.shape == (len(lens), hq, d) and out.dtype == dtype
    assert lse.shape == (len(lens), hq) and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_reference_is_softmax_attention() -> None:
    """The reference itself, on a case small enough to write out: one head, two keys."""
    q = torch.tensor([[[1.0, 0.0]]])  # (1, 1, 2)
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[5.0, 5.0]]])  # slots 0, 1, 2
    v = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[9.0, 9.0]]])
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    args = (q, k, v, table, torch.tensor([0]), torch.tensor([0]), torch.tensor([2]), 1.0)
    p = torch.softmax(torch.tensor([1.0, 0.0]), 0)  # slot 2 is past the length: unread
    for out, lse in (paged_decode_reference(*args), kernel()(*args)):
        torch.testing.assert_close(out[0, 0], p[0] * v[0, 0] + p[1] * v[1, 0])
        torch.testing.assert_close(lse[0, 0], torch.logsumexp(torch.tensor([1.0, 0.0]), 0))


def test_kernel_rejects_bad_inputs() -> None:
    q, k, v, table, rows, starts, lens = make_inputs([5, 6], [0, 0], 4, 2, 8, torch.float32)
    op = kernel()
    with pytest.raises(RuntimeError, match="bad starts"):
        op(q, k, v, table, rows, starts, torch.tensor([5, table.shape[1] + 1]), 1.0)
    with pytest.raises(RuntimeError, match="bad starts"):
        op(q, k, v, table, rows, torch.tensor([0, 6]), lens, 1.0)  # empty range
    with pytest.raises(RuntimeError, match="int32"):
        op(q, k, v, table.long(), rows, starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(q, k.double(), v, table, rows, starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(q.double(), k.double(), v.double(), table, rows, starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(q, k.transpose(0, 1).contiguous().transpose(0, 1), v, table, rows, starts, lens, 1.0)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ENV_DISABLE, "1")
    assert load_paged_decode() is None
    assert load_prefill_attention() is None


@pytest.mark.usefixtures("broken_native_build")
def test_build_failure_falls_back_to_torch(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert load_paged_decode() is None
        assert load_prefill_attention() is None
    assert "CPU attention kernels unavailable at " in caplog.text
    assert "error: no compiler here); using torch's kernels" in caplog.text
    # the backend without it still attends (the torch path: tests/attention/test_torch_backend.py)
    assert TorchAttentionBackend(None).paged_decode is None


def prefill_kernel() -> cpu_kernels.PrefillAttention:
    op = load_prefill_attention()
    assert op is not None, "the kernel must build where the tests run (gcc + ninja)"
    return op


def prefill_inputs(m: int, p: int, hq: int, hkv: int, d: int, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, ...]:
    """A chunk of m tokens after p cached ones at scattered slots of a layer of the pool; q,
    k, v strided slices of one fused (m, hq + 2 hkv, d) projection, as the model passes them."""
    g = torch.Generator().manual_seed(m * 1000 + p)
    num_slots = 2 * p + 8
    k_cache = torch.randn(2, num_slots, hkv, d, generator=g).to(dtype)[1]
    v_cache = torch.randn(2, num_slots, hkv, d, generator=g).to(dtype)[1]
    qkv = (torch.randn(m, hq + 2 * hkv, d, generator=g) * 2).to(dtype)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    slots = torch.randperm(num_slots, generator=g)[:p].int()
    return q, k, v, k_cache, v_cache, slots


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 4, 64), (8, 2, 64), (4, 1, 128),
                                              (6, 2, 32)])
@pytest.mark.parametrize(("m", "p"), [(1, 0), (31, 0), (33, 0), (130, 0), (300, 0), (1, 70),
                                      (45, 19), (100, 64), (257, 333)])
def test_prefill_kernel_matches_reference(dtype: torch.dtype, tol: float, hq: int, hkv: int,
                                          d: int, m: int, p: int) -> None:
    """Lengths off the kernel's 32-blocks, with and without a cached prefix, GQA groups of
    1, 3, 4; head dims 32, 64, 128."""
    args = prefill_inputs(m, p, hq, hkv, d, dtype)
    out, lse = prefill_kernel()(*args, d**-0.5)
    ref_out, ref_lse = prefill_attention_reference(*args, d**-0.5)
    assert out.shape == (m, hq, d) and out.dtype == dtype
    assert lse.shape == (m, hq) and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [2, 3])
def test_prefill_kernel_in_parallel(threads: int) -> None:
    """Tasks (KV head, query block) split over threads cover every query exactly once."""
    args = prefill_inputs(300, 45, 9, 3, 64, torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = prefill_kernel()(*args, 0.125)
    finally:
        torch.set_num_threads(before)
    ref_out, ref_lse = prefill_attention_reference(*args, 0.125)
    torch.testing.assert_close(out.double(), ref_out.double(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_prefill_reference_is_causal_attention() -> None:
    """The reference on a case small enough to write out: one head, one prefix key, two new
    (vectors of 2 values padded with zeros to the kernel's smallest head_dim, 32)."""
    def pad(rows: list[list[float]]) -> torch.Tensor:  # -> (n, 1, 32)
        return torch.nn.functional.pad(torch.tensor(rows), (0, 30)).unsqueeze(1)

    q = pad([[1.0, 0.0], [0.0, 1.0]])
    k = pad([[2.0, 0.0], [0.0, 3.0]])
    v = pad([[1.0, 1.0], [5.0, 7.0]])
    k_cache = pad([[9.0, 9.0], [0.0, 0.0]])  # slot 1 is the prefix key
    v_cache = pad([[0.0, 0.0], [2.0, 4.0]])
    args = (q, k, v, k_cache, v_cache, torch.tensor([1], dtype=torch.int32), 1.0)
    first = torch.softmax(torch.tensor([0.0, 2.0]), 0)  # token 0: prefix key, itself
    second = torch.softmax(torch.tensor([0.0, 0.0, 3.0]), 0)  # token 1: all three
    for out, lse in (prefill_attention_reference(*args), prefill_kernel()(*args)):
        torch.testing.assert_close(out[0, 0], first[0] * v_cache[1, 0] + first[1] * v[0, 0])
        torch.testing.assert_close(out[1, 0], second[0] * v_cache[1, 0] + second[1] * v[0, 0]
                                   + second[2] * v[1, 0])
        torch.testing.assert_close(lse[1, 0], torch.logsumexp(torch.tensor([0.0, 0.0, 3.0]), 0))


def test_prefill_kernel_rejects_bad_inputs() -> None:
    q, k, v, kc, vc, slots = prefill_inputs(5, 3, 4, 2, 64, torch.float32)
    op = prefill_kernel()
    with pytest.raises(RuntimeError, match="bad slot"):
        op(q, k, v, kc, vc, torch.tensor([0, kc.shape[0]], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        op(q, k, v, kc, vc, slots.long(), 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(q, k.double(), v, kc, vc, slots, 1.0)
    with pytest.raises(RuntimeError, match="token count"):
        op(q, k[:4], v[:4], kc, vc, slots, 1.0)
    with pytest.raises(RuntimeError, match="head_dim must be"):
        q2, k2, v2, kc2, vc2, s2 = prefill_inputs(5, 3, 4, 2, 16, torch.float32)
        op(q2, k2, v2, kc2, vc2, s2, 1.0)
