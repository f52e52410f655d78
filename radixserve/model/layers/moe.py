"""The mixture-of-experts feed-forward block: router, top-k, grouped expert GEMMs, shared expert.

Owns: the routing math (router linear, softmax over experts in fp32, top-k, renormalised or
not: HF's TopKRouter order), the CPU grouped-expert compute, Qwen2-MoE's sigmoid-gated shared
expert, and the partial-sum contract under tensor / expert parallelism. On the model's fused
path (CUDA's Triton backend) the experts run as one Triton fused MoE
(triton_kernels/fused_moe.py), else as the grouped compute below; quantized experts run as
the caller's ExpertsKernel (moe_quant.py; the shared types: moe_types.py). Does not know:
checkpoints (moe_weights.py), attention, the decoder loop, collectives (the caller
all-reduces).

CPU grouped compute (no loop over tokens): the (token, expert) pairs are sorted once by expert
(a stable sort: each expert's tokens stay in token order), the sorted pairs' rows gathered
with one index_select, then one gate_up GEMM, SiLU * up and one down GEMM per *active* expert
over its contiguous rows (a decode step at batch 1 touches only its k experts' weights), the
top-k weights applied in one multiply and the rows scattered back with one index_add_ (in
sorted order: each token's experts are summed in ascending expert order, as HF sums them).
Where the native op builds (model/moe_kernel.py: csrc/moe/, per CPU tier), the whole of the
above is one call per layer on the stacked weights: it groups the pairs itself, so no count
is read on the host, and streams each active expert's weights once for all its rows (kept
in 2 MB pages: moe_pages.py). A bf16 prefill on a CPU without AVX512-BF16
(moe_kernel.native_fits) runs the torch path below on the same stacked weights (oneDNN's
bf16 GEMMs are faster there; it reads the counts).
Without it, where oneDNN prepacking applies (cpu_linear.py's rule), each expert's gate, up
and down are prepacked at load (replacing the stacked copy) and run with the silu and the
product as GEMM epilogues, as the dense GatedMLP does; this torch path reads the counts on
the host (group_by_expert) and is the native op's specification.

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

from radixserve.model.cpu_linear import GatedMLP, prepack
from radixserve.model.layers.moe_pages import to_huge_pages
from radixserve.model.layers.moe_spec import MoESpec
from radixserve.model.layers.moe_types import Experts, ExpertsKernel, SharedExpert
from radixserve.model.layers.moe_types import Routing as Routing  # re-exported: its home was here
from radixserve.model.moe_kernel import (
    MoEExpertsOp,
    bf16_dot_products,
    load_moe_experts,
    native_fits,
    quantize_experts,
)
from radixserve.model.quantization.experts import StackedQWeight
from radixserve.model.quantization.qweight import LinearWeight
from radixserve.model_source import ModelLoadError


@dataclass
class MoEWeights:
    """One sparse layer's weights as this rank holds them (stacked once at load)."""

    router: torch.Tensor  # (E, hidden): every rank routes over all experts
    # float, or a quantized checkpoint's experts (layers/moe_quant.py runs those)
    gate_up: torch.Tensor | StackedQWeight  # (E_local, 2 * F_local, hidden): gate, then up rows
    down: torch.Tensor | StackedQWeight  # (E_local, hidden, F_local)
    first_expert: int = 0  # global index of gate_up[0] (expert parallelism)
    # Qwen2-MoE's shared expert: float, or a quantized checkpoint's QWeights (gate, up)
    shared_gate_up: LinearWeight | None = None  # (2 * S_local, hidden)
    shared_down: LinearWeight | None = None  # (hidden, S_local)
    shared_gate: torch.Tensor | None = None  # (1, hidden): sigmoid(x @ shared_gate.T)

    @property
    def nbytes(self) -> int:
        """Bytes as loaded (quantized weights: their codes, scales and zero points)."""
        n = sum(t.nbytes for t in (self.router, self.gate_up, self.down, self.shared_gate)
                if t is not None)
        for w in (self.shared_gate_up, self.shared_down):
            qs = [] if w is None or isinstance(w, torch.Tensor) else w
            n += (w.nbytes if isinstance(w, torch.Tensor) else 0) + sum(
                q.codes.nbytes + q.scale.nbytes + (0 if q.zero is None else q.zero.nbytes)
                for q in qs)
        return n


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


PackedExpert = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # oneDNN gate, up, down


def pack_experts(gate_up: torch.Tensor, down: torch.Tensor) -> list[PackedExpert] | None:
    """Each expert's gate, up and down in oneDNN's prepacked layout (cpu_linear.py: faster
    than F.linear on the plain weight at a decode step's few rows), or None where that does
    not apply (CUDA, a dtype or build without it)."""
    inter = gate_up.shape[1] // 2
    packed = []
    for e in range(gate_up.shape[0]):
        parts = (prepack(gate_up[e, :inter]), prepack(gate_up[e, inter:]), prepack(down[e]))
        if parts[0] is None or parts[1] is None or parts[2] is None:
            return None
        packed.append((parts[0], parts[1], parts[2]))
    return packed


def _packed_expert(rows: torch.Tensor, expert: PackedExpert) -> torch.Tensor:  # (n, hidden)
    gate, up, down = expert
    lp = torch.ops.mkldnn._linear_pointwise
    act = lp(rows, gate, None, "swish", [], "")  # silu(rows @ gate.T): (n, F)
    act = lp.binary(rows, act, up, None, "mul")  # (rows @ up.T) * act
    out: torch.Tensor = lp(act, down, None, "none", [], "")
    return out


def expert_gemms(rows: torch.Tensor, counts: list[int], gate_up: Experts | None,
                 down: Experts | None, packed: list[PackedExpert] | None = None
                 ) -> torch.Tensor:  # (P, hidden)
    """down(silu(gate(rows)) * up(rows)) with expert e's weights on its run of `counts[e]`
    contiguous rows: one GEMM pair per active expert, nothing for an idle one. `packed`:
    the experts' oneDNN layout (pack_experts) in place of the stacked weights."""
    outs, end = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        start, end = end, end + n
        if packed is not None:
            outs.append(_packed_expert(rows[start:end], packed[e]))
            continue
        assert gate_up is not None and down is not None
        gu = F.linear(rows[start:end], gate_up[e])  # (n, 2 * F)
        inter = gu.shape[1] // 2
        act = F.silu(gu[:, :inter]) * gu[:, inter:]  # (n, F)
        outs.append(F.linear(act, down[e]))  # (n, hidden)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def grouped_experts(x: torch.Tensor, routing: Routing, gate_up: Experts | None,
                    down: Experts | None, num_experts: int, first_expert: int = 0,
                    packed: list[PackedExpert] | None = None
                    ) -> torch.Tensor:  # (T, hidden): this rank's experts' weighted sum
    """sum over each token's local top-k experts of weight * down(silu(gate(x)) * up(x)),
    with one GEMM pair per active expert over its contiguous sorted rows."""
    if packed is not None:
        num_local = len(packed)
    else:
        assert gate_up is not None
        num_local = int(gate_up.shape[0])
    groups = group_by_expert(routing.expert_ids, num_experts, first_expert, num_local)
    out = x.new_zeros(x.shape)  # (T, hidden)
    if groups.pairs.numel() == 0:
        return out
    rows = x.index_select(0, groups.token_rows)  # (P, hidden) grouped by expert
    expert_out = expert_gemms(rows, groups.counts, gate_up, down, packed)  # (P, hidden)
    weights = routing.weights.reshape(-1).index_select(0, groups.pairs)  # (P,)
    expert_out.mul_(weights.unsqueeze(1))
    return out.index_add_(0, groups.token_rows, expert_out)


class MoEBlock:
    """residual + experts(x) (+ the gated shared expert); without the residual where it is
    None (a parallel rank's partial sum). Called like cpu_linear.GatedMLP."""

    def __init__(self, spec: MoESpec, weights: MoEWeights, prepacked: bool = True,
                 native: bool = True, int8: bool = False,
                 quant: ExpertsKernel | None = None, shared: SharedExpert | None = None
                 ) -> None:
        """`prepacked`: False on the fused (CUDA) path, which runs the stacked weights.
        `native`: the native CPU op where it builds (else the torch grouped compute).
        `int8`: the experts as int8 codes with per-channel scales (--quantization int8; the
        native op only: refused where it is not available). `quant`: the experts of a
        quantized checkpoint or --quantization fp8, built by the caller from the weights'
        StackedQWeights (layers/moe_quant.py), which run in place of everything below.
        `shared`: the shared expert built by the caller (a quantized one); None: from the
        weights' float tensors."""
        self.spec = spec
        self.router = weights.router
        self.quant = quant
        self.first_expert = weights.first_expert
        self.num_local_experts = int(weights.gate_up.shape[0])
        self.native: MoEExpertsOp | None = None
        self.packed: list[PackedExpert] | None = None
        self.gate_up: torch.Tensor | None = None
        self.down: torch.Tensor | None = None
        self.scales: tuple[torch.Tensor, torch.Tensor] | None = None  # int8: (E, 2F), (E, D)
        self._shared(weights, prepacked, shared)
        if quant is not None:
            self.bf16_dot = False
            self.nbytes = quant.nbytes + self._other_bytes(weights, shared is not None)
            return
        assert isinstance(weights.gate_up, torch.Tensor) and isinstance(weights.down,
                                                                        torch.Tensor)
        if prepacked and native:
            self.native = load_moe_experts(weights.gate_up.device, weights.gate_up.dtype)
        self.bf16_dot = self.native is not None and bf16_dot_products()
        use_packed = prepacked and self.native is None and not int8
        self.packed = pack_experts(weights.gate_up, weights.down) if use_packed else None
        # NOTE: the packed copies replace the stacked weights: one copy in memory.
        if self.packed is None:
            self.gate_up, self.down = weights.gate_up, weights.down
        if int8:
            if self.native is None:
                raise ModelLoadError(
                    "--quantization int8 runs a mixture-of-experts model's experts on the "
                    "native CPU MoE kernel, which is not available here (not CPU, the fused "
                    "path, or the build failed): serve it in its dtype (no --quantization)")
            self.gate_up, gate_up_scale = quantize_experts(weights.gate_up)
            self.down, down_scale = quantize_experts(weights.down)
            self.scales = (gate_up_scale, down_scale)
        if self.native is not None:  # the op streams these every decode step: 2 MB pages
            assert self.gate_up is not None and self.down is not None
            self.gate_up, self.down = to_huge_pages(self.gate_up), to_huge_pages(self.down)
        # stacked, packed (the same size) or int8 codes with their scales
        held = (weights.gate_up, weights.down) if self.scales is None else (
            self.gate_up, self.down, *self.scales)
        self.nbytes = sum(t.nbytes for t in held if t is not None) + self._other_bytes(
            weights, shared is not None)

    def _other_bytes(self, weights: MoEWeights, built: bool) -> int:
        """The router's, its shared expert's and the shared gate's bytes (`built`: a shared
        expert the caller built, e.g. quantized; a float one's prepacked copy is the size of
        its weights)."""
        ts: list[LinearWeight | None] = [weights.router, weights.shared_gate]
        if not built:
            ts += [weights.shared_gate_up, weights.shared_down]
        n = sum(t.nbytes for t in ts if isinstance(t, torch.Tensor))
        return n + (self.shared.nbytes if built and self.shared is not None else 0)

    def _shared(self, weights: MoEWeights, prepacked: bool, shared: SharedExpert | None
                ) -> None:
        self.shared: SharedExpert | None = shared
        self.shared_gate = weights.shared_gate
        if shared is None and weights.shared_gate_up is not None:
            gate_up, down = weights.shared_gate_up, weights.shared_down
            assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor), \
                "a quantized shared expert is built by the caller"
            self.shared = GatedMLP(gate_up, down, prepacked=prepacked)

    def experts(self, x: torch.Tensor, routing: Routing, fused: bool = False
                ) -> torch.Tensor:  # (T, hidden)
        """`fused`: the Triton fused MoE (the model's fused path: CUDA, or the interpreter)."""
        if self.quant is not None:
            return self.quant(x, routing, fused)
        if fused:
            # Imported here: triton is never needed on the CPU path.
            from triton_kernels.fused_moe import fused_moe

            assert self.gate_up is not None and self.down is not None
            return fused_moe(x, routing.weights, routing.expert_ids, self.gate_up, self.down,
                             first_expert=self.first_expert)
        if self.native is not None and (self.scales is not None or native_fits(
                x.shape[0], self.spec.top_k, self.spec.num_experts, x.dtype, self.bf16_dot)):
            return self.native(x, routing.weights, routing.expert_ids, self.gate_up, self.down,
                               self.first_expert, *(self.scales or ()))
        return grouped_experts(x, routing, self.gate_up, self.down, self.spec.num_experts,
                               self.first_expert, self.packed)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None,
                 fused: bool = False) -> torch.Tensor:
        routing = route(x, self.router, self.spec.top_k, self.spec.renormalize)
        out = self.experts(x, routing, fused)  # (T, hidden)
        if self.shared is not None:
            assert self.shared_gate is not None
            gate = torch.sigmoid(F.linear(x, self.shared_gate))  # (T, 1)
            out = out + gate * self.shared(x, None)
        return out if residual is None else residual + out
