"""Reading one sparse layer's expert weights from either checkpoint layout, stacked per layer.

Owns: the two layouts' tensor names, which experts and which slice of each expert one rank
reads (`ExpertPart`: expert parallelism or tensor parallelism), the divisibility refusals, and
stacking per-expert tensors into one (E_local, ...) tensor at load (no per-expert Python runs
at forward time). Does not know: the forward (moe.py), the rest of the model's weights.

Layouts (names after the "model." prefix, layer prefix `layers.{i}.`):
- per expert, as transformers writes them on save (4.x and 5.x alike):
  `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` (Qwen-MoE, OLMoE) or
  `block_sparse_moe.experts.{e}.w1/w3/w2.weight` (Mixtral: w1 gate, w3 up, w2 down), the
  router `mlp.gate.weight` / `block_sparse_moe.gate.weight`;
- packed, transformers 5's in-memory layout: `mlp.experts.gate_up_proj` (E, 2F, hidden; gate
  rows then up rows) and `mlp.experts.down_proj` (E, hidden, F), router `mlp.gate.weight`.
Qwen2-MoE's shared expert: `mlp.shared_expert.{gate,up,down}_proj.weight` and
`mlp.shared_expert_gate.weight`, in both layouts.
Quantized experts (a checkpoint whose quantization_config covers the per-expert
projections: compressed-tensors `experts.{e}.gate_proj.weight_packed` / `weight_scale` /
`weight_shape`, FP8 `weight` + `weight_scale(_inv)`, AWQ / GPTQ `qweight`, ...) are read per
expert by the dense readers (quantization/formats.py, this rank's rows and columns) and
stacked into one StackedQWeight per projection; the router is read as a float tensor
whatever the config says (vLLM never quantizes it either; a quantized one is a load error
naming it); Qwen2-MoE's shared expert is read as the dense layers are (its QWeights where
quantized, in float where not).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from radixserve.config.parsing import ConfigError
from radixserve.model.layers.moe import MoEWeights
from radixserve.model.layers.moe_spec import MoESpec
from radixserve.model.quantization.experts import StackedQWeight, stack_experts
from radixserve.model.quantization.qweight import LinearWeight, QWeight, can_stack, stack_rows
from radixserve.model_source import ModelLoadError

Take = Callable[..., torch.Tensor]  # (name, rows=None, cols=None) -> tensor on the device
# (module, rows=None, cols=None) -> its QWeight, or None where the checkpoint stores it in float
QTake = Callable[..., QWeight | None]
_PER_EXPERT = {"mlp": ("gate_proj", "up_proj", "down_proj"), "block_sparse_moe": ("w1", "w3", "w2")}


@dataclass(frozen=True)
class ExpertPart:
    """The experts [first_expert, first_expert + num_local) and, of each, the intermediate
    rows `rows` (None: all) one rank holds; `shared_rows` likewise of the shared expert."""

    first_expert: int
    num_local: int
    rows: slice | None = None
    shared_rows: slice | None = None


def _slice(rank: int, size: int, total: int) -> slice:
    n = total // size
    return slice(rank * n, (rank + 1) * n)


def check_moe_parallel(spec: MoESpec, size: int, expert_parallel: bool) -> None:
    """Raises ConfigError when `size` ranks cannot split this model's experts evenly."""
    problems = []
    if expert_parallel and spec.num_experts % size:
        ok = [n for n in range(1, 17) if spec.num_experts % n == 0]
        problems.append(f"--enable-expert-parallel places num_experts / tensor_parallel_size "
                        f"experts on each rank, but the model's {spec.num_experts} experts are "
                        f"not divisible by {size} (sizes that divide them: "
                        f"{', '.join(map(str, ok))})")
    if not expert_parallel and spec.expert_size % size:
        problems.append(f"each expert's intermediate size {spec.expert_size} is not divisible "
                        f"by tensor_parallel_size {size} (try --enable-expert-parallel)")
    if spec.shared_expert_size % size:
        problems.append(f"the shared expert's intermediate size {spec.shared_expert_size} is "
                        f"not divisible by tensor_parallel_size {size}")
    if problems:
        raise ConfigError("; ".join(problems))


def expert_part(spec: MoESpec, rank: int = 0, size: int = 1,
                expert_parallel: bool = False) -> ExpertPart:
    """Rank `rank` of `size`'s part (size 1: everything)."""
    check_moe_parallel(spec, size, expert_parallel)
    shared = _slice(rank, size, spec.shared_expert_size) if size > 1 else None
    if expert_parallel:
        local = spec.num_experts // size
        return ExpertPart(rank * local, local, None, shared)
    rows = _slice(rank, size, spec.expert_size) if size > 1 else None
    return ExpertPart(0, spec.num_experts, rows, shared)


def _stack_per_expert(take: Take, base: str, names: tuple[str, str, str], spec: MoESpec,
                      part: ExpertPart) -> tuple[torch.Tensor, torch.Tensor]:
    gate_n, up_n, down_n = names
    experts = range(part.first_expert, part.first_expert + part.num_local)
    first = take(f"{base}.{experts[0]}.{gate_n}.weight", part.rows)  # (F_local, hidden)
    inter, hidden = first.shape
    gate_up = first.new_empty(part.num_local, 2 * inter, hidden)  # (E_local, 2F, hidden)
    down = first.new_empty(part.num_local, hidden, inter)  # (E_local, hidden, F)
    for j, e in enumerate(experts):
        gate_up[j, :inter] = first if j == 0 else take(f"{base}.{e}.{gate_n}.weight", part.rows)
        gate_up[j, inter:] = take(f"{base}.{e}.{up_n}.weight", part.rows)
        down[j] = take(f"{base}.{e}.{down_n}.weight", None, part.rows)
    return gate_up, down


def _packed(take: Take, base: str, spec: MoESpec, part: ExpertPart
            ) -> tuple[torch.Tensor, torch.Tensor]:
    experts = slice(part.first_expert, part.first_expert + part.num_local)
    if part.rows is None:
        return take(f"{base}.gate_up_proj", experts), take(f"{base}.down_proj", experts)
    f = spec.expert_size
    up_rows = slice(f + part.rows.start, f + part.rows.stop)
    gate_up = torch.cat([take(f"{base}.gate_up_proj", experts, part.rows),
                         take(f"{base}.gate_up_proj", experts, up_rows)], dim=1)
    down = take(f"{base}.down_proj", experts)[:, :, part.rows].contiguous()  # (E, hidden, F)
    return gate_up, down


def _quantized(qtake: QTake, module: str, rows: slice | None, cols: slice | None
               ) -> QWeight:
    q = qtake(module, rows, cols)
    if q is None:
        raise ModelLoadError(f"{module}: stored in float while the layer's other expert "
                             "projections are quantized; every expert projection of a layer "
                             "must share one scheme")
    return _no_perm(q, module)


def _no_perm(q: QWeight, module: str) -> QWeight:
    if q.perm is not None:
        raise ModelLoadError(f"{module}: act-order (GPTQ desc_act) expert weights are not "
                             "supported; quantize the experts without desc_act")
    return q


def _stack_quantized(qtake: QTake, base: str, names: tuple[str, str, str], part: ExpertPart,
                     first: QWeight) -> tuple[StackedQWeight, StackedQWeight]:
    """Each local expert's gate, up (stacked as gate_up) and down QWeights, stacked."""
    gate_n, up_n, down_n = names
    gate_up, down = [], []
    for j, e in enumerate(range(part.first_expert, part.first_expert + part.num_local)):
        gate = first if j == 0 else _quantized(qtake, f"{base}.{e}.{gate_n}", part.rows, None)
        up = _quantized(qtake, f"{base}.{e}.{up_n}", part.rows, None)
        if not can_stack([gate, up]):
            raise ModelLoadError(f"{base}.{e}: gate and up quantized with different schemes")
        gate_up.append(stack_rows([gate, up]))  # (2F_local, hidden)
        down.append(_quantized(qtake, f"{base}.{e}.{down_n}", None, part.rows))
    return stack_experts(gate_up, f"{base} gate/up"), stack_experts(down, f"{base} down")


def load_moe_weights(take: Take, names: Collection[str], prefix: str, spec: MoESpec,
                     part: ExpertPart, qtake: QTake | None = None) -> MoEWeights:
    """Layer `prefix` ("layers.{i}.")'s MoE weights in whichever layout `names` (the
    checkpoint's tensor names) holds; `qtake`: the checkpoint's quantized reader (None: a
    float checkpoint)."""
    block = "block_sparse_moe" if f"{prefix}block_sparse_moe.gate.weight" in names else "mlp"
    base = f"{prefix}{block}.experts"
    gate_n = f"{base}.{part.first_expert}.{_PER_EXPERT[block][0]}"
    first = None
    if qtake is not None and f"{base}.gate_up_proj" not in names:
        first = qtake(gate_n, part.rows)
        first = None if first is None else _no_perm(first, gate_n)
    gate_up: torch.Tensor | StackedQWeight
    down: torch.Tensor | StackedQWeight
    if first is not None:
        gate_up, down = _stack_quantized(qtake, base, _PER_EXPERT[block], part,  # type: ignore[arg-type]
                                         first)
    elif f"{base}.gate_up_proj" in names:
        gate_up, down = _packed(take, base, spec, part)
    elif f"{gate_n}.weight" in names:
        gate_up, down = _stack_per_expert(take, base, _PER_EXPERT[block], spec, part)
    else:
        raise ModelLoadError(f"layer {prefix!r}: no expert weights found (looked for "
                             f"{base}.gate_up_proj and {base}.<i>.{_PER_EXPERT[block][0]})")
    expected = (part.num_local, 2 * (spec.expert_size if part.rows is None
                                     else part.rows.stop - part.rows.start))
    if tuple(gate_up.shape[:2]) != expected:
        raise ModelLoadError(f"{base}: expert weights of shape {tuple(gate_up.shape)}, "
                             f"expected {expected} + (hidden,)")
    weights = MoEWeights(router=take(f"{prefix}{block}.gate.weight"), gate_up=gate_up,
                         down=down, first_expert=part.first_expert)
    if spec.shared_expert_size:
        s = f"{prefix}mlp.shared_expert."
        rows = part.shared_rows
        weights.shared_gate_up = _linear([_part(take, qtake, s + "gate_proj", rows, None),
                                          _part(take, qtake, s + "up_proj", rows, None)], s)
        weights.shared_down = _linear([_part(take, qtake, s + "down_proj", None, rows)], s)
        weights.shared_gate = take(f"{prefix}mlp.shared_expert_gate.weight")
    return weights


def _part(take: Take, qtake: QTake | None, module: str, rows: slice | None,
          cols: slice | None) -> torch.Tensor | QWeight:
    """A dense projection (the shared expert's): its QWeight where quantized, else float."""
    q = None if qtake is None else qtake(module, rows, cols)
    return take(module + ".weight", rows, cols) if q is None else _no_perm(q, module)


def _linear(parts: list[torch.Tensor | QWeight], what: str) -> LinearWeight:
    """Float projections concatenated, or all quantized (weights.py's rule)."""
    floats = [p for p in parts if isinstance(p, torch.Tensor)]
    if len(floats) == len(parts):
        return floats[0] if len(floats) == 1 else torch.cat(floats)
    if floats:
        raise ModelLoadError(f"{what}: some of its projections are quantized and some are "
                             "not; they must share one scheme")
    return [p for p in parts if isinstance(p, QWeight)]
