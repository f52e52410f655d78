"""The CPU fast paths of the forward against plain references: cascade attention (shared
groups, padding, masks) against per-request attention in float64, prepacked bf16 linears and
the fused MLP against F.linear, the bf16 RMSNorm against HF's order, the rotary identity."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionMetadata, SharedPrefix
from radixserve.attention.cpu_kernels import load_paged_decode, load_prefill_attention
from radixserve.attention.torch_backend import SHORT_QUERY_MAX, TorchAttentionBackend
from radixserve.attention.varlen import MIN_VARLEN_TOKENS
from radixserve.engine.sampler import Sampler
from radixserve.model.arch import RopeSpec
from radixserve.model.cpu_linear import GatedMLP, Linear, can_prepack, make_linear
from radixserve.model.norm_rope import rms_norm_reference as rms_norm
from radixserve.model.norm_rope import rope_qk_reference
from radixserve.model.rope import RotaryTable
from radixserve.sched.req import Req
from radixserve.types import Phase, SamplingParams

HKV, G, D, NUM_SLOTS = 2, 3, 32, 4096
Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# CPU runs the fused flash kernel, CUDA the matmul + logsumexp path of the same plan.
DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA device")])]


def build_meta(phase: Phase, prefix_lens: list[int], extend_lens: list[int],
               table: torch.Tensor, groups: list[tuple[list[int], int]],
               device: str = "cpu") -> AttentionMetadata:
    B = len(prefix_lens)
    rows = list(range(B))
    seq = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    cu = [0]
    for n in extend_lens:
        cu.append(cu[-1] + n)
    own_start = [0] * B
    shared = []
    for members, length in groups:
        slots = table[members[0], :length].long()
        consecutive = bool((slots.diff() == 1).all())
        shared.append(SharedPrefix(torch.tensor(members, device=device), slots.to(device), length,
                                   members_cpu=tuple(members),
                                   first_slot=int(slots[0]) if consecutive else None))
        for b in members:
            own_start[b] = length
    out_slots = torch.cat([table[r, p : p + n] for r, p, n in
                           zip(rows, prefix_lens, extend_lens, strict=True)]).long()

    def ints(xs: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(xs, dtype=dtype, device=device)

    return AttentionMetadata(
        phase=phase, slot_table=table.to(device), rows=ints(rows, torch.int64),
        prefix_lens=ints(prefix_lens), extend_lens=ints(extend_lens), seq_lens=ints(seq),
        cu_extend=ints(cu), out_slots=out_slots.to(device), prefix_lens_cpu=tuple(prefix_lens),
        extend_lens_cpu=tuple(extend_lens), max_seq_len=max(seq),
        max_extend_len=max(extend_lens), rows_cpu=tuple(rows), shared=tuple(shared),
        own_start=ints(own_start, torch.int64), own_start_cpu=tuple(own_start))


def make_table(seq_lens: list[int], shared: list[tuple[list[int], int]], consecutive: bool,
               gen: torch.Generator) -> torch.Tensor:
    """Slot table: members of a group share their first `length` slots (the tree pages)."""
    perm = torch.randperm(NUM_SLOTS, generator=gen)
    nxt = 0
    table = torch.zeros(len(seq_lens), max(seq_lens) + 1, dtype=torch.int32)

    def take(n: int) -> torch.Tensor:
        nonlocal nxt
        if consecutive:
            out = torch.arange(nxt, nxt + n, dtype=torch.int32)
        else:
            out = perm[nxt : nxt + n].int()
        nxt += n
        return out

    for members, length in shared:
        prefix = take(length)
        for b in members:
            table[b, :length] = prefix
    starts = {b: length for members, length in shared for b in members}
    for b, n in enumerate(seq_lens):
        s = starts.get(b, 0)
        table[b, s:n] = take(n - s)
    return table


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Per request, float64: every new token attends to slots [0, its position]."""
    out = []
    start = 0
    for row, p, n in zip(meta.rows_cpu, meta.prefix_lens_cpu, meta.extend_lens_cpu, strict=True):
        slots = meta.slot_table[row, : p + n].long()
        keys = k_cache[slots].double().repeat_interleave(G, dim=1)  # (L, Hq, D)
        values = v_cache[slots].double().repeat_interleave(G, dim=1)
        qb = q[start : start + n].double()  # (n, Hq, D)
        scores = torch.einsum("nhd,lhd->hnl", qb, keys) * scale
        causal = torch.arange(p + n)[None, :] <= torch.arange(p, p + n)[:, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out.append(torch.einsum("hnl,lhd->nhd", probs, values))
        start += n
    return torch.cat(out)


CASES = {
    # name: (phase, prefix_lens, extend_lens, groups)
    "decode, one group of all": (Phase.DECODE, [70, 75, 70, 90], [1, 1, 1, 1],
                                 [([0, 1, 2, 3], 64)]),
    "decode, equal lengths": (Phase.DECODE, [80, 80, 80], [1, 1, 1], [([0, 1, 2], 66)]),
    "decode, two groups + loner": (Phase.DECODE, [70, 71, 90, 95, 12], [1] * 5,
                                   [([0, 1], 64), ([2, 3], 80)]),
    "extend, padded, group of some": (Phase.PREFILL, [64, 64, 0], [5, 16, 9], [([0, 1], 64)]),
    "extend, no group": (Phase.PREFILL, [0, 30, 7], [12, 3, 20], []),
    "extend, lone request": (Phase.PREFILL, [40], [17], []),
    # drafts to verify (<= SHORT_QUERY_MAX new tokens each): one decode-kernel row per token
    "verify, drafts in a group": (Phase.PREFILL, [70, 75, 70, 90], [5, 1, 3, 8],
                                  [([0, 1, 2, 3], 64)]),
    "verify, drafts, group + loner": (Phase.PREFILL, [66, 80, 12], [4, 2, 5], [([0, 1], 64)]),
    "decode, lone request": (Phase.DECODE, [40], [1], []),
    # long extends (>= MIN_VARLEN_TOKENS new tokens) take the varlen path, the rest the cascade
    "extend, long chunk alone": (Phase.PREFILL, [0], [130], []),
    "extend, long chunks after prefixes": (Phase.PREFILL, [64, 64, 10], [70, 65, 3],
                                           [([0, 1], 64)]),
    "mixed, decodes + long chunks": (Phase.PREFILL, [70, 0, 75, 40, 66], [1, 80, 1, 100, 4],
                                     [([0, 2, 4], 64)]),
    # longer than CAUSAL_CHUNK: query chunks, each merged with the tokens before it
    "extend, long chunk in query chunks": (Phase.PREFILL, [0, 0], [600, 257], []),
    "extend, query chunks after a prefix": (Phase.PREFILL, [100, 64, 64], [300, 2, 520],
                                            [([1, 2], 64)]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_backend_matches_per_request_reference(case: str, dtype: torch.dtype,
                                               consecutive: bool, device: str,
                                               kernel: str) -> None:
    """kernel "native": decode tokens and short chunks through csrc/paged_decode.cpp, long extends
    through csrc/prefill_attention.cpp (CPU only)."""
    if kernel == "native" and device != "cpu":
        pytest.skip("the native kernels are CPU-only")
    phase, prefix_lens, extend_lens, groups = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    seq = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    table = make_table(seq, groups, consecutive, gen)
    meta = build_meta(phase, prefix_lens, extend_lens, table, groups, device)
    T = sum(extend_lens)
    k_cache = torch.randn(NUM_SLOTS, HKV, D, generator=gen).to(device, dtype)
    v_cache = torch.randn(NUM_SLOTS, HKV, D, generator=gen).to(device, dtype)
    # q as the model passes it: a strided slice of a wider rotated tensor
    q = torch.randn(T, HKV * G + HKV, D, generator=gen).to(device, dtype)[:, : HKV * G]
    k = torch.randn(T, HKV, D, generator=gen).to(device, dtype)
    v = torch.randn(T, HKV, D, generator=gen).to(device, dtype)
    calls: dict[str, int] = {"decode": 0, "prefill": 0}

    def counted(name: str, op: Kernel | None) -> Kernel:
        assert op is not None  # the build works here: it is under test

        def call(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
            calls[name] += 1
            return op(*args)
        return call

    backend = TorchAttentionBackend()
    if kernel == "native":
        backend = TorchAttentionBackend(counted("decode", load_paged_decode()),
                                        counted("prefill", load_prefill_attention()))
    out = backend.forward(q, k, v, k_cache, v_cache, meta, D**-0.5)
    # decode tokens and short chunks go through the decode kernel (once, when every short
    # chunk is short enough); each long extend is one prefill call
    native = kernel == "native"
    short = [n for n in extend_lens if n < MIN_VARLEN_TOKENS]
    assert calls["decode"] == (native and bool(short) and max(short) <= SHORT_QUERY_MAX)
    assert calls["prefill"] == native * sum(n >= MIN_VARLEN_TOKENS for n in extend_lens)
    assert torch.equal(k_cache[meta.out_slots], k) and torch.equal(v_cache[meta.out_slots], v)
    ref = reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), build_meta(
        phase, prefix_lens, extend_lens, table, groups, "cpu"), D**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.shape == (T, HKV * G, D) and out.dtype == dtype and out.device == q.device
    torch.testing.assert_close(out.double().cpu(), ref, rtol=tol, atol=tol)
    # a second layer reuses the plan; its keys differ, so its output must too
    out2 = backend.forward(q, k * 2, v, k_cache * 2, v_cache, meta, D**-0.5)
    assert not torch.equal(out2, out)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_prepacked_linear_and_fused_mlp_match_f_linear(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    gate_up = (torch.randn(2 * 80, 64, generator=gen) * 0.1).to(dtype)
    down = (torch.randn(64, 80, generator=gen) * 0.1).to(dtype)
    lin, lin_b, mlp = Linear(w), Linear(w, bias), GatedMLP(gate_up, down)
    if torch._C._has_mkldnn and (
            dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        assert can_prepack(w.device, dtype)
        # the fast paths are under test, each with one copy of the weights: the panels or
        # oneDNN's prepacked one (RADIXSERVE_CPU_PANEL_GEMM=0, or the op unavailable)
        assert (lin.packed is None) == (lin.panels is not None)
        assert lin.weight is None
        assert mlp.gate is not None and mlp.up is not None and mlp.gate_up is None
        assert lin.nbytes == w.numel() * w.element_size()
    for m in (1, 7, 32, 300):
        x = torch.randn(m, 64, generator=gen).to(dtype)
        res = torch.randn(m, 96, generator=gen).to(dtype)
        ref = x.double() @ w.double().t()
        torch.testing.assert_close(lin(x).double(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(lin_b(x).double(), ref + bias.double(), rtol=tol, atol=tol)
        torch.testing.assert_close(lin.add_to(res, x).double(), res.double() + ref,
                                   rtol=tol, atol=tol)
        g, u = (x.double() @ gate_up.double().t()).chunk(2, dim=-1)
        h = torch.randn(m, 64, generator=gen).to(dtype)
        ref = h.double() + (F.silu(g) * u) @ down.double().t()
        torch.testing.assert_close(mlp(x, h).double(), ref, rtol=2 * tol, atol=2 * tol)


def test_plain_linear_where_prepacking_is_off_or_unsupported() -> None:
    w, x = torch.randn(8, 4), torch.randn(3, 4)
    lin = Linear(w, prepacked=False)
    assert lin.packed is None and lin.weight is w
    assert torch.equal(lin(x), F.linear(x, w))
    mlp = GatedMLP(torch.randn(10, 4), torch.randn(4, 5), prepacked=False)
    assert mlp.gate is None and mlp.gate_up is not None
    # dtypes oneDNN's linear does not take, and non-CPU devices, stay on F.linear
    assert not can_prepack(torch.device("cpu"), torch.float16)
    assert not can_prepack(torch.device("cuda"), torch.float32)
    half = make_linear(w.half(), None, None)
    assert isinstance(half, Linear) and half.packed is None
    xh = x.half()
    assert torch.equal(half(xh), F.linear(xh, w.half()))


def test_rms_norm_bf16_close_to_hf_order_and_fp32_exact() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(50, 64, generator=gen)
    w = torch.rand(64, generator=gen) + 0.5
    hf = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(rms_norm(x, w, 1e-5), hf)
    xb, wb = x.bfloat16(), w.bfloat16()
    xf = xb.float()
    hf_bf16 = wb * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    out = rms_norm(xb, wb, 1e-5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), hf_bf16.float(), rtol=1e-2, atol=1e-2)


def test_rotary_equals_hf_rotate_half_exactly() -> None:
    table = RotaryTable(RopeSpec(theta=10000.0), 64, 128, torch.float32, torch.device("cpu"))
    pos = torch.tensor([0, 5, 127, 64])
    x = torch.randn(4, 3, 64)
    cos, sin = table.lookup(pos)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    emb = torch.cat([torch.outer(pos.float(), inv)] * 2, dim=-1)[:, None, :]
    rotate_half = torch.cat([-x[..., 32:], x[..., :32]], dim=-1)
    rotated = rope_qk_reference(x.view(4, 3 * 64), cos, sin, 3)
    assert torch.equal(rotated, x * emb.cos() + rotate_half * emb.sin())


def test_greedy_picks_the_first_of_tied_maxima() -> None:
    logits = torch.zeros(3, 1000)
    logits[0, [7, 500]] = 2.0
    logits[2, [999, 3]] = 1.0
    reqs = [Req(rid=str(i), token_ids=[1], num_prompt_tokens=1,
                params=SamplingParams(temperature=0), max_new_tokens=4) for i in range(3)]
    result = Sampler((0,), 0, torch.device("cpu")).sample(logits, reqs)
    assert result.token_ids == [7, 0, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_math_partial_matches_the_cpu_kernel(dtype: torch.dtype) -> None:
    """The CUDA path of a partial attention (matmul + logsumexp) against the CPU kernel."""
    from radixserve.attention.torch_backend import _attend, _attend_math

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(4, 2, 9, 32, generator=gen).to(dtype)
    keys = torch.randn(4, 2, 20, 32, generator=gen).to(dtype)
    values = torch.randn(4, 2, 20, 32, generator=gen).to(dtype)
    keep = torch.rand(4, 1, 9, 20, generator=gen) > 0.3
    keep[..., 0] = True
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))
    out, lse = _attend(q, keys, values, mask, 0.2)
    out_m, lse_m = _attend_math(q, keys, values, mask, 0.2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), out_m.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, lse_m, rtol=tol, atol=tol)


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = torch.zeros(3, 1000)
    logits[:, 7] = 5.0  # the greedy choice of every row without a bias
    params = [SamplingParams(temperature=0, logit_bias={9: 100}),  # forced
              SamplingParams(temperature=0, logit_bias={7: -100, 8: 4.9}),  # banned: 8 wins
              SamplingParams(temperature=0)]
    reqs = [Req(rid=str(i), token_ids=[1], num_prompt_tokens=1, params=p, max_new_tokens=4)
            for i, p in enumerate(params)]
    sampler = Sampler((0,), 0, torch.device("cpu"))
    assert sampler.sample(logits, reqs).token_ids == [9, 8, 7]
    assert logits[0, 9] == 0 and logits[1, 7] == 5  # the model's logits are not changed
    # sampled (not greedy): a -100 bias removes a token whatever the draw
    hot = [Req(rid="s", token_ids=[1], num_prompt_tokens=1, max_new_tokens=4,
               params=SamplingParams(temperature=1.0, seed=s, logit_bias={7: -100}))
           for s in range(20)]
    assert 7 not in sampler.sample(logits[:1].expand(20, -1).contiguous(), hot).token_ids
