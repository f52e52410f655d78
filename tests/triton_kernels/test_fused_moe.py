"""The Triton fused MoE against its torch reference and the CPU grouped experts.

Runs on CUDA when present, else on CPU through Triton's interpreter (TRITON_INTERPRET=1 set
by tests/conftest.py before triton is first imported). Shapes cover batch 1 (decode), hidden
and expert widths that are not multiples of the tiles, uneven expert loads (some experts with
no token), top-k of 1, 3 and 8, and expert parallelism (only a range of experts held here).
"""

from __future__ import annotations

import pytest
import torch

from radixserve.model.layers.moe import Routing, grouped_experts
from triton_kernels.fused_moe import BLOCK_M, max_padded_len, moe_align
from triton_kernels.fused_moe import fused_moe as fused_moe_kernel
from triton_kernels.reference import fused_moe_ref
from triton_kernels.testing import device_or_error

DEVICE, DEVICE_ERROR = device_or_error()
F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture
def runnable_kernels() -> None:
    if DEVICE_ERROR:
        pytest.fail(DEVICE_ERROR, pytrace=False)


def _case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype,
          seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    # Skewed routing scores: uneven loads, some experts unused at small T.
    scores = torch.randn(tokens, experts, generator=g) + torch.linspace(2, -2, experts)
    weights, ids = torch.softmax(scores, -1).topk(top_k, dim=-1)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    return tuple(t.to(DEVICE, dtype) if t.is_floating_point() else t.to(DEVICE)
                 for t in (x, weights, ids, gate_up, down))


CASES = [(1, 64, 32, 8, 2), (37, 96, 48, 8, 3), (5, 64, 80, 16, 8), (24, 32, 16, 4, 1)]


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize(("tokens", "hidden", "inter", "experts", "top_k"), CASES)
def test_fused_moe_matches_reference_fp32(tokens: int, hidden: int, inter: int, experts: int,
                                          top_k: int) -> None:
    x, w, ids, gate_up, down = _case(tokens, hidden, inter, experts, top_k, F32)
    out = fused_moe_kernel(x, w, ids, gate_up, down)
    torch.testing.assert_close(out, fused_moe_ref(x, w, ids, gate_up, down),
                               rtol=1e-5, atol=1e-5)
    cpu = grouped_experts(x.cpu(), Routing(w.cpu(), ids.cpu()), gate_up.cpu(), down.cpu(),
                          experts)
    torch.testing.assert_close(out.cpu(), cpu, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("runnable_kernels")
def test_fused_moe_bf16() -> None:
    x, w, ids, gate_up, down = _case(19, 64, 48, 8, 2, BF16)
    out = fused_moe_kernel(x, w, ids, gate_up, down)
    ref = fused_moe_ref(x.float(), w.float(), ids, gate_up.float(), down.float())
    torch.testing.assert_close(out.float(), ref, rtol=2**-6, atol=2**-6)


@pytest.mark.usefixtures("runnable_kernels")
def test_fused_moe_expert_parallel_part() -> None:
    x, w, ids, gate_up, down = _case(21, 64, 32, 8, 3, F32)
    parts = [fused_moe_kernel(x, w, ids, gate_up[r * 4 : (r + 1) * 4].contiguous(),
                              down[r * 4 : (r + 1) * 4].contiguous(), first_expert=r * 4)
             for r in range(2)]
    torch.testing.assert_close(parts[1], fused_moe_ref(x, w, ids, gate_up[4:], down[4:], 4),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts[0] + parts[1], fused_moe_ref(x, w, ids, gate_up, down),
                               rtol=1e-5, atol=1e-5)


def test_align_blocks_hold_one_expert_each_and_every_pair_once() -> None:
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [0, 1], [5, 1]])  # (T=5, k=2), expert 4 unused
    aligned = moe_align(ids, first_expert=0, num_local=6, block_m=4)
    pairs, blocks = aligned.sorted_pairs, aligned.block_experts
    assert pairs.shape[0] == max_padded_len(10, 6, 4) and blocks.shape[0] * 4 == pairs.shape[0]
    real = pairs[pairs < 10]
    assert sorted(real.tolist()) == list(range(10))
    flat = ids.reshape(-1)
    for b, e in enumerate(blocks.tolist()):
        block = pairs[b * 4 : (b + 1) * 4]
        block = block[block < 10]
        if e < 0:
            assert block.numel() == 0
        else:
            assert (flat[block.long()] == e).all() and block.numel() > 0
    assert blocks.tolist()[:5] == [0, 1, 2, 3, 5]  # expert 1 has 4 pairs: one full block
    # Expert parallelism: experts [2, 4) only, pairs of others dropped.
    part = moe_align(ids, first_expert=2, num_local=2, block_m=BLOCK_M)
    held = part.sorted_pairs[part.sorted_pairs < 10]
    assert sorted(flat[held.long()].tolist()) == [2, 3, 3]


@pytest.mark.gpu
def test_fused_moe_captures_in_a_cuda_graph() -> None:
    """No host sync in the routing alignment: capture, then replay on new routing."""
    dev = torch.device("cuda")
    x, w, ids, gate_up, down = (t.to(dev) for t in _case(8, 128, 64, 16, 4, BF16))
    fused_moe_kernel(x, w, ids, gate_up, down)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_kernel(x, w, ids, gate_up, down)
    ids.copy_(torch.randint(0, 16, ids.shape, device=dev))
    graph.replay()
    ref = fused_moe_ref(x.float(), w.float(), ids, gate_up.float(), down.float())
    torch.testing.assert_close(out.float(), ref, rtol=2**-6, atol=2**-6)
