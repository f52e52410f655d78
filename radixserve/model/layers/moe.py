"""The mixture-of-experts feed-forward block: router, top-k, grouped expert GEMMs, shared expert.

Owns: the routing math (router linear, softmax over experts in fp32, top-k, renormalised or
not: HF's TopKRouter order), the CPU grouped-expert compute, Qwen2-MoE's sigmoid-gated shared
expert, and the partial-sum contract under tensor / expert parallelism. On CUDA the experts run
as one Triton fused MoE (triton_kernels/fused_moe.py). Does not know: checkpoints
(moe_weights.py), attention, the decoder loop, collectives (the caller all-reduces).

CPU grouped compute (no loop over tokens): the (token, expert) pairs are sorted once by expert
(a stable sort: each expert's tokens stay in token order), the sorted pairs' rows gathered
with one index_select, then one gate_up GEMM, SiLU * up and one down GEMM per *active* expert
over its contiguous rows (a decode step at batch 1 touches only its k experts' weights), the
top-k weights applied in one multiply and the rows scattered back with one index_add_ (in
sorted order: each token's experts are summed in ascending expert order, as HF sums them).

Parallelism: with expert parallelism a rank holds experts [first_expert, first_expert + E/N)
whole and computes only the pairs routed to them; with tensor parallelism every rank holds a
slice of every expert's intermediate width. Either way the block returns this rank's partial
sum, and the caller's one all-reduce adds the ranks' partials (the residual comes in on one
rank only, as for the dense MLP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from radixserve.model.cpu_linear import GatedMLP
from radixserve.model.layers.moe_spec import MoESpec


class Routing(NamedTuple):
    weights: torch.Tensor  # (T, k) in the activations' dtype
    expert_ids: torch.Tensor  # (T, k) int64, global expert indices


@dataclass
class MoEWeights:
    """One sparse layer's weights as this rank holds them (stacked once at load)."""

    router: torch.Tensor  # (E, hidden): every rank routes over all experts
    gate_up: torch.Tensor  # (E_local, 2 * F_local, hidden): gate rows, then up rows
    down: torch.Tensor  # (E_local, hidden, F_local)
    first_expert: int = 0  # global index of gate_up[0] (expert parallelism)
    shared_gate_up: torch.Tensor | None = None  # (2 * S_local, hidden) Qwen2-MoE
    shared_down: torch.Tensor | None = None  # (hidden, S_local)
    shared_gate: torch.Tensor | None = None  # (1, hidden): sigmoid(x @ shared_gate.T)

    @property
    def nbytes(self) -> int:
        ts = (self.router, self.gate_up, self.down, self.shared_gate_up, self.shared_down,
              self.shared_gate)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """HF's TopKRouter: softmax over the router logits in fp32, top-k, optionally divided by
    the top-k sum, then cast to x's dtype."""
    logits = F.linear(x, router)  # (T, E)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (T, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # (T, k) each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights.to(x.dtype), ids)


class ExpertGroups(NamedTuple):
    pairs: torch.Tensor  # (P,) flat pair index (token * k + slot) of the local pairs, by expert
    token_rows: torch.Tensor  # (P,) the token of each pair
    counts: list[int]  # pairs per local expert, in expert order (sum = P)


def group_by_expert(expert_ids: torch.Tensor, num_experts: int, first_expert: int,
                    num_local: int) -> ExpertGroups:
    """The pairs routed to experts [first_expert, first_expert + num_local), sorted by expert
    (stable: token order within an expert). One sort, one bincount, one host read of the
    counts (free on CPU; the CUDA path never calls this)."""
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)  # (T * k,)
    order = torch.argsort(flat, stable=True)  # (T * k,) pairs by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = sum(counts[:first_expert])
    local = counts[first_expert : first_expert + num_local]
    pairs = order[start : start + sum(local)]  # (P,)
    return ExpertGroups(pairs, pairs // top_k, local)


def grouped_experts(x: torch.Tensor, routing: Routing, gate_up: torch.Tensor,
                    down: torch.Tensor, num_experts: int, first_expert: int = 0
                    ) -> torch.Tensor:  # (T, hidden): this rank's experts' weighted sum
    """sum over each token's local top-k experts of weight * down(silu(gate(x)) * up(x)),
    with one GEMM pair per active expert over its contiguous sorted rows."""
    groups = group_by_expert(routing.expert_ids, num_experts, first_expert, gate_up.shape[0])
    out = x.new_zeros(x.shape)  # (T, hidden)
    if not groups.counts or groups.pairs.numel() == 0:
        return out
    rows = x.index_select(0, groups.token_rows)  # (P, hidden) grouped by expert
    expert_out = torch.empty_like(rows)  # (P, hidden)
    inter = gate_up.shape[1] // 2
    end = 0
    for e, n in enumerate(groups.counts):
        if n == 0:
            continue
        start, end = end, end + n
        gu = F.linear(rows[start:end], gate_up[e])  # (n, 2 * F)
        act = F.silu(gu[:, :inter]) * gu[:, inter:]  # (n, F)
        torch.mm(act, down[e].t(), out=expert_out[start:end])  # (n, hidden)
    weights = routing.weights.reshape(-1).index_select(0, groups.pairs)  # (P,)
    expert_out.mul_(weights.unsqueeze(1))
    return out.index_add_(0, groups.token_rows, expert_out)


class MoEBlock:
    """residual + experts(x) (+ the gated shared expert); without the residual where it is
    None (a parallel rank's partial sum). Called like cpu_linear.GatedMLP."""

    def __init__(self, spec: MoESpec, weights: MoEWeights, prepacked: bool = True) -> None:
        self.spec = spec
        self.router = weights.router
        self.gate_up, self.down = weights.gate_up, weights.down
        self.first_expert = weights.first_expert
        self.shared: GatedMLP | None = None
        self.shared_gate = weights.shared_gate
        if weights.shared_gate_up is not None:
            assert weights.shared_down is not None and weights.shared_gate is not None
            self.shared = GatedMLP(weights.shared_gate_up, weights.shared_down,
                                   prepacked=prepacked)
        self.nbytes = weights.nbytes  # the shared expert's prepacked copy is the same size

    @property
    def num_local_experts(self) -> int:
        return int(self.gate_up.shape[0])

    def experts(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:  # (T, hidden)
        if x.device.type == "cuda":
            # Imported here: triton is never needed on CPU.
            from triton_kernels.fused_moe import fused_moe

            return fused_moe(x, routing.weights, routing.expert_ids, self.gate_up, self.down,
                             first_expert=self.first_expert)
        return grouped_experts(x, routing, self.gate_up, self.down, self.spec.num_experts,
                               self.first_expert)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        routing = route(x, self.router, self.spec.top_k, self.spec.renormalize)
        out = self.experts(x, routing)  # (T, hidden)
        if self.shared is not None:
            assert self.shared_gate is not None
            gate = torch.sigmoid(F.linear(x, self.shared_gate))  # (T, 1)
            out = out + gate * self.shared(x, None)
        return out if residual is None else residual + out
