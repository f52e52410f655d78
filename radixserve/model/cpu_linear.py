"""Linear layers in the layouts the device's fastest kernels want: on CPU ours or oneDNN's.

Owns: `Linear` (y = x @ W.T + bias, optionally plus a residual), `GateUp` (SwiGLU's gate and
up with the silu and product fused), `GatedMLP` (SwiGLU with the residual add, MoE's shared
expert), the choice between the skinny op, oneDNN's prepacked weights and plain `F.linear`, and
`make_linear`, which also hands out quant.py's Int8Linear. Does not know: the model's layers
(llama.py), configs, attention.

Prepacked (CPU, fp32 or bf16 where oneDNN has it, when the skinny op below is unavailable: its
build failed, or RADIXSERVE_NO_CPU_KERNELS=1): every weight is reordered once, at load,
into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`) and multiplied with
`mkldnn._linear_pointwise`, whose epilogues also fuse SwiGLU's silu and product and the
residual adds. The packed tensor replaces the plain weight: one copy in memory. It is
faster than `F.linear` on the same weights for decode steps and prefill chunks, fp32 and
bf16 (figures: bench/README.md). fp32 results differ from `F.linear`'s in the last bits
(another accumulation order, ~5e-6 absolute on unit-scale outputs); the greedy tokens of the
HF parity tests stay identical (tests/model/test_parity.py runs with it on).
Plain `F.linear` where prepacking does not apply: CUDA, other dtypes, a torch build without
oneDNN (or bf16 support in it), or `prepack=False`.

Skinny (CPU, fp32 or bf16, opted in with RADIXSERVE_CPU_SKINNY_GEMM=1 where the native op
builds: model/skinny_kernel.py says what it trades): a decode step
of at most skinny_kernel.MAX_ROWS rows runs our own GEMM on the plain (N, K) weight, which
streams the weight at the memory's bandwidth where oneDNN's M=1 product reaches about half of
it; more rows (prefill) run oneDNN's GEMM on that same plain tensor (the weight is not
prepacked: still one copy in memory, and a tied LM head shares the embedding's). Each row of
the skinny op is computed the same way at any row count (batch invariance).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from radixserve.model.int8_kernel import Int8Gemm
from radixserve.model.quant import Int8Linear
from radixserve.model.skinny_kernel import (
    MAX_ROWS,
    SkinnyLinear,
    load_skinny_linear,
    skinny_enabled,
)

PACK_BATCH_HINT = 32  # oneDNN picks its blocking for this many rows; any row count works


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of this device and dtype get oneDNN's prepacked layout."""
    if device.type != "cpu" or not torch._C._has_mkldnn:
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack(weight: torch.Tensor, enabled: bool = True) -> torch.Tensor | None:
    """The weight (N, K) in oneDNN's blocked layout, or None where that is not used."""
    if not (enabled and can_prepack(weight.device, weight.dtype)):
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(),
                                                                       PACK_BATCH_HINT)
    except RuntimeError:  # an op missing from this build: the plain path
        return None
    return packed


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


Skinny = SkinnyLinear | None | Literal["load"]  # the op, none, or load it at this tier


def skinny_op(weight: torch.Tensor, prepacked: bool, skinny: Skinny) -> SkinnyLinear | None:
    """The skinny op for this weight (None: the prepacked or plain path)."""
    if not prepacked or weight.device.type != "cpu" or weight.dtype not in (torch.float32,
                                                                            torch.bfloat16):
        return None
    if skinny == "load":
        return load_skinny_linear() if skinny_enabled() else None
    return skinny


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                   onednn: bool, act: str = "none") -> torch.Tensor:
    """x @ w.T (+ bias), then act ("none" or "swish"): oneDNN's GEMM on the plain weight
    where it takes the dtype, else torch's."""
    if onednn:
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, w, bias, act, [], "")
        return y
    y = F.linear(x, w, bias)
    return F.silu(y) if act == "swish" else y


class Linear:
    """y = x @ weight.T (+ bias), optionally plus a residual (as the GEMM's epilogue)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 prepacked: bool = True, skinny: Skinny = "load") -> None:
        self.bias = bias if bias is None else bias.contiguous()
        self.skinny = skinny_op(weight, prepacked, skinny)
        # NOTE: one copy in memory: the plain weight (skinny) or the packed one replacing it.
        self.packed = None if self.skinny is not None else prepack(weight, prepacked)
        self.weight = weight.contiguous() if self.packed is None else None
        self.onednn = self.skinny is not None and can_prepack(weight.device, weight.dtype)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed) + _nbytes(self.weight) + _nbytes(self.bias)

    def _skinny(self, x: torch.Tensor) -> bool:
        return self.skinny is not None and x.dim() == 2 and x.shape[0] <= MAX_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out)
        if self.packed is not None:
            y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias,
                                                                 "none", [], "")
            return y
        assert self.weight is not None
        if self._skinny(x):
            assert self.skinny is not None
            return self.skinny(x, self.weight, self.bias, None, None)
        if self.skinny is not None:
            return _onednn_linear(x, self.weight, self.bias, self.onednn)
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ weight.T (+ bias); (M, out)."""
        operand = self.packed if self.packed is not None else self.weight
        if self._skinny(x) and residual.dtype == x.dtype and residual.is_contiguous():
            assert self.skinny is not None and self.weight is not None
            return self.skinny(x, self.weight, self.bias, residual, None)
        if self.packed is not None or self.onednn:
            y: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(
                x, residual, operand, self.bias, "add")
            return y
        return residual + self(x)


class GateUp:
    """silu(x @ gate.T) * (x @ up.T), (M, hidden) -> (M, inter): SwiGLU's two projections and
    its product. Skinny: one call of the op for a decode step, and oneDNN's GEMMs on the plain
    halves (their epilogues apply the silu and the product) for more rows; else the halves
    prepacked for oneDNN. `make` returns None where neither applies (the MLP then runs one
    gate_up GEMM and torch's activation)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, skinny: SkinnyLinear | None,
                 onednn: bool) -> None:
        self.gate, self.up, self.skinny, self.onednn = gate, up, skinny, onednn

    @classmethod
    def make(cls, gate_up: torch.Tensor, skinny: Skinny = "load") -> GateUp | None:
        inter = gate_up.shape[0] // 2
        op = skinny_op(gate_up, True, skinny)
        if op is not None:  # contiguous halves of the one plain tensor
            gate_up = gate_up.contiguous()
            return cls(gate_up[:inter], gate_up[inter:], op,
                       can_prepack(gate_up.device, gate_up.dtype))
        gate, up = prepack(gate_up[:inter]), prepack(gate_up[inter:])
        return None if gate is None or up is None else cls(gate, up, None, True)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.gate) + _nbytes(self.up)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny is not None and x.dim() == 2 and x.shape[0] <= MAX_ROWS:
            return self.skinny(x, self.gate, None, None, self.up)
        act = _onednn_linear(x, self.gate, None, self.onednn, "swish")  # silu(x @ gate.T)
        if self.onednn:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(
                x, act, self.up, None, "mul")  # (x @ up.T) * act
            return out
        return F.linear(x, self.up) * act


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None,
                prepacked: bool = True, int8_gemm: Int8Gemm | None | Literal["load"] = "load"
                ) -> Linear | Int8Linear:
    """`int8_gemm`: Int8Linear's `native` kernel (pass one loaded once for many layers)."""
    if quantization == "int8":
        return Int8Linear(weight, bias, int8_gemm)
    assert quantization is None, quantization  # validated at the edge (EngineConfig)
    return Linear(weight, bias, prepacked)


class GatedMLP:
    """residual + down(silu(gate(x)) * up(x)) (without the residual where it is None).

    Prepacked: gate and up are two GEMMs whose epilogues apply the silu and the product, and
    the residual add is down's epilogue: no (M, intermediate) temporaries beyond the two GEMM
    outputs (a faster prefill MLP; figures: bench/README.md). Otherwise HF's order on the
    fused gate_up weight; int8: one fused gate_up matmul (its kernels have no epilogues).
    """

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor,
                 quantization: str | None = None, prepacked: bool = True,
                 int8_gemm: Int8Gemm | None | Literal["load"] = "load") -> None:
        inter = gate_up.shape[0] // 2
        self.down = make_linear(down, None, quantization, prepacked, int8_gemm)
        self.gate_up_q = Int8Linear(gate_up, None, int8_gemm) if quantization == "int8" else None
        gate = up = None
        if self.gate_up_q is None:
            gate, up = prepack(gate_up[:inter], prepacked), prepack(gate_up[inter:], prepacked)
        self.gate_up = gate_up if self.gate_up_q is None and (gate is None or up is None) else None
        self.gate, self.up = (gate, up) if self.gate_up is None else (None, None)

    @property
    def nbytes(self) -> int:
        n = sum(_nbytes(p) for p in (self.gate_up, self.gate, self.up))
        return n + (0 if self.gate_up_q is None else self.gate_up_q.nbytes) + self.down.nbytes

    def gate_up_proj(self, x: torch.Tensor) -> torch.Tensor:  # (M, hidden) -> (M, 2 * inter)
        """The fused projection: gate columns, then up columns (not for prepacked weights)."""
        if self.gate_up_q is not None:
            return self.gate_up_q(x)
        assert self.gate_up is not None, "prepacked gate/up weights have no fused projection"
        return F.linear(x, self.gate_up)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """`residual` None: down's output alone (a tensor-parallel rank's partial sum)."""
        if self.gate_up_q is None and self.gate_up is None:
            lp = torch.ops.mkldnn._linear_pointwise
            act = lp(x, self.gate, None, "swish", [], "")  # silu(x @ gate.T): (M, inter)
            act = lp.binary(x, act, self.up, None, "mul")  # (x @ up.T) * act
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (M, inter) each
            act = F.silu(gate) * up
        return self.down(act) if residual is None else self.down.add_to(residual, act)
