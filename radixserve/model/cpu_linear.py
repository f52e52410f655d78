"""Linear layers in the layouts the device's fastest kernels want: on CPU ours or oneDNN's.

Owns: `Linear` (y = x @ W.T + bias, optionally plus a residual), `GateUp` (SwiGLU's gate and
up with the silu and product fused), `GatedMLP` (SwiGLU with the residual add, MoE's shared
expert), the choice between the panel GEMM, oneDNN's prepacked weights and plain `F.linear`,
and `make_linear`, which also hands out quant.py's Int8Linear. Does not know: the model's
layers (llama.py), configs, attention.

Panel (CPU, fp32 or bf16, the default where the native op builds: model/panel_kernel.py): every
weight is packed once, at load, into panels of output channels that a decode step streams at
the memory's bandwidth and a prefill tile reuses from cache; our GEMM multiplies it at every
row count, with the bias, the residual add and SwiGLU's silu and product as its epilogue. The
packed tensor replaces the plain weight: one copy in memory. Against oneDNN's prepacked
layout it is about 2x faster for one row (a decode step at batch 1), faster up to ~64 rows
and level at 256 (bench/README.md, "The panel GEMM"). Each row's sum is in one fixed order,
so a row's bits do not depend on the batch (batch invariance). fp32 results differ from
`F.linear`'s in the last bits (another accumulation order); the greedy tokens of the HF
parity tests stay identical (tests/model/test_parity.py runs with it on).
Prepacked (CPU, fp32 or bf16 where oneDNN has it, when the panel op is unavailable: its build
failed, RADIXSERVE_NO_CPU_KERNELS=1, or RADIXSERVE_CPU_PANEL_GEMM=0): every weight is
reordered once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`) and multiplied
with `mkldnn._linear_pointwise`, whose epilogues also fuse SwiGLU's silu and product and the
residual adds.
Plain `F.linear` where neither applies: CUDA, other dtypes, a torch build without oneDNN (or
bf16 support in it), or `prepacked=False`.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.nn.functional as F

from radixserve.model.int8_kernel import Int8Gemm
from radixserve.model.panel_kernel import PanelOp, load_panel_op, pack, pack_gated
from radixserve.model.quant import Int8Linear

PACK_BATCH_HINT = 32  # oneDNN picks its blocking for this many rows; any row count works
ENV_PANEL = "RADIXSERVE_CPU_PANEL_GEMM"  # "0": oneDNN's prepacked weights instead


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


Panel = PanelOp | None | Literal["load"]  # the op, none, or load it at this tier


def load_default_panel(device: torch.device) -> PanelOp | None:
    """The panel op for a model's float linears on `device`: CPU, unless opted out."""
    if device.type != "cpu" or os.environ.get(ENV_PANEL, "").strip() == "0":
        return None
    return load_panel_op()


def panel_op(weight: torch.Tensor, enabled: bool, panel: Panel) -> PanelOp | None:
    """The panel op for this weight (None: the prepacked or plain path)."""
    if not enabled or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    return load_default_panel(weight.device) if panel == "load" else panel


class Linear:
    """y = x @ weight.T (+ bias), optionally plus a residual (as the GEMM's epilogue)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 prepacked: bool = True, panel: Panel = "load") -> None:
        self.bias = bias if bias is None else bias.contiguous()
        self.out_features = weight.shape[0]
        self.panel = panel_op(weight, prepacked, panel)
        # NOTE: one copy in memory: the panels, oneDNN's packed weight or the plain one.
        self.panels = None if self.panel is None else pack(weight, self.panel.width)
        self.bias32 = None if self.panel is None or bias is None else bias.float().contiguous()
        self.packed = None if self.panel is not None else prepack(weight, prepacked)
        plain = self.panels is None and self.packed is None
        self.weight = weight.contiguous() if plain else None

    @property
    def nbytes(self) -> int:
        tensors = (self.panels, self.packed, self.weight, self.bias)
        return sum(_nbytes(t) for t in tensors) + _nbytes(self.bias32)

    def _panel(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        assert self.panel is not None and self.panels is not None
        op, n = self.panel.linear, self.out_features
        if x.dim() == 2:  # the forward's case: no reshapes (121 calls a decode step)
            return op(x, self.panels, n, self.bias32, residual, False)
        r2 = None if residual is None else residual.reshape(-1, n)
        y = op(x.reshape(-1, x.shape[-1]), self.panels, n, self.bias32, r2, False)  # (M, n)
        return y.view(*x.shape[:-1], n)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out)
        if self.panel is not None:
            return self._panel(x, None)
        if self.packed is not None:
            y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias,
                                                                 "none", [], "")
            return y
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ weight.T (+ bias); (M, out)."""
        if self.panel is not None and residual.dtype == x.dtype and residual.is_contiguous():
            return self._panel(x, residual)
        if self.packed is not None:
            y: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(
                x, residual, self.packed, self.bias, "add")
            return y
        return residual + self(x)


class GateUp:
    """silu(x @ gate.T) * (x @ up.T), (M, hidden) -> (M, inter): SwiGLU's two projections and
    its product. Panel: one call of the op on the interleaved gate and up panels; else the
    halves prepacked for oneDNN, whose epilogues apply the silu and the product. `make`
    returns None where neither applies (the MLP then runs one gate_up GEMM and torch's
    activation)."""

    def __init__(self, inter: int, panels: torch.Tensor | None = None, op: PanelOp | None = None,
                 gate: torch.Tensor | None = None, up: torch.Tensor | None = None) -> None:
        self.inter, self.panels, self.op, self.gate, self.up = inter, panels, op, gate, up

    @classmethod
    def make(cls, gate_up: torch.Tensor, panel: Panel = "load") -> GateUp | None:
        inter = gate_up.shape[0] // 2
        op = panel_op(gate_up, True, panel)
        if op is not None:
            return cls(inter, pack_gated(gate_up[:inter], gate_up[inter:], op.width), op)
        gate, up = prepack(gate_up[:inter]), prepack(gate_up[inter:])
        return None if gate is None or up is None else cls(inter, gate=gate, up=up)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.panels) + _nbytes(self.gate) + _nbytes(self.up)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.op is not None:
            assert self.panels is not None
            if x.dim() == 2:
                return self.op.linear(x, self.panels, self.inter, None, None, True)
            y = self.op.linear(x.reshape(-1, x.shape[-1]), self.panels, self.inter, None, None,
                               True)  # (M, inter)
            return y.view(*x.shape[:-1], self.inter)
        lp = torch.ops.mkldnn._linear_pointwise
        act = lp(x, self.gate, None, "swish", [], "")  # silu(x @ gate.T): (M, inter)
        out: torch.Tensor = lp.binary(x, act, self.up, None, "mul")  # (x @ up.T) * act
        return out


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
