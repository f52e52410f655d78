"""Reading safetensors weights into the fused layout the forward pass uses.

Owns: name mapping from HF checkpoints (q/k/v fused into qkv, gate/up fused into gate_up, or
read fused where the checkpoint stores them so: Phi-3's qkv_proj / gate_up_proj; a family's
extra per-layer tensors such as QK-norms and Gemma's feed-forward norms: WeightNames),
dtype/device placement, the loading progress bar, and reading only a tensor-parallel rank's
slices (tp_shard.py says which). Does not know: the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from radixserve.model.arch import ModelArch
from radixserve.model_source import ModelLoadError

if TYPE_CHECKING:
    from radixserve.model.tp_shard import TPShard


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # ((heads + 2 * kv_heads) * head_dim, hidden)
    qkv_bias: torch.Tensor | None  # ((heads + 2 * kv_heads) * head_dim,)
    o_proj: torch.Tensor  # (hidden, heads * head_dim)
    post_norm: torch.Tensor  # (hidden,)
    gate_up: torch.Tensor  # (2 * intermediate, hidden)
    down: torch.Tensor  # (hidden, intermediate)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # WeightNames.extra's


@dataclass(frozen=True)
class WeightNames:
    """A family's per-layer checkpoint names (under `layers.N.`) where they are not Llama's."""

    fused_qkv: str | None = None  # e.g. "self_attn.qkv_proj": q, k, v rows in one tensor
    fused_gate_up: str | None = None  # e.g. "mlp.gate_up_proj": gate rows, then up rows
    extra: tuple[str, ...] = ()  # replicated per-layer weights, e.g. "self_attn.q_norm"


@dataclass
class ModelWeights:
    embed: torch.Tensor  # (vocab, hidden)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # (hidden,)
    lm_head: torch.Tensor  # (vocab, hidden); the embedding itself when tied


class _Checkpoint:
    """The checkpoint's tensors by name (without the "model." prefix), read one at a time,
    whole or one slice of rows/columns (a tensor-parallel rank reads only its shard)."""

    def __init__(self, hf_dir: Path, stack: ExitStack) -> None:
        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{hf_dir}: no *.safetensors weights (only safetensors are "
                                 "loaded)")
        self.hf_dir = hf_dir
        self.where: dict[str, tuple[Any, str]] = {}  # name -> (open file, key)
        for f in files:
            sf = stack.enter_context(safe_open(str(f), framework="pt"))
            self.where.update((k.removeprefix("model."), (sf, k)) for k in sf.keys())

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None
             ) -> torch.Tensor:
        if name not in self.where:
            raise ModelLoadError(f"{self.hf_dir}: weight {name!r} missing from the checkpoint")
        sf, key = self.where[name]
        if rows is None and cols is None:
            tensor: torch.Tensor = sf.get_tensor(key)
            return tensor
        part = sf.get_slice(key)
        whole = slice(None)
        sliced: torch.Tensor = part[rows or whole] if cols is None else part[rows or whole, cols]
        return sliced


def _pad_rows(t: torch.Tensor, num_rows: int) -> torch.Tensor:
    if t.shape[0] == num_rows:
        return t
    return torch.cat([t, t.new_zeros(num_rows - t.shape[0], *t.shape[1:])])


def load_weights(
    hf_dir: Path, spec: ModelArch, dtype: torch.dtype, device: torch.device,
    show_progress: bool = True, shard: TPShard | None = None,
    names: WeightNames = WeightNames(),
) -> ModelWeights:
    """The model's weights (`names`: the family's checkpoint names); with `shard`, only that tensor-parallel rank's slices
    (model/tp_shard.py), the vocabulary shard padded to vocab_per_rank rows."""
    with ExitStack() as stack:
        ckpt = _Checkpoint(hf_dir, stack)
        bar = stack.enter_context(tqdm(total=len(ckpt.where), desc="Loading weights",
                                       disable=not show_progress, leave=False))

        def take(name: str, rows: slice | None = None, cols: slice | None = None
                 ) -> torch.Tensor:
            bar.update(1)
            return ckpt.read(name, rows, cols).to(device=device, dtype=dtype).contiguous()

        return _load(spec, take, shard, "lm_head.weight" in ckpt.where, names)


Take = Callable[..., torch.Tensor]  # (name, rows=None, cols=None) -> tensor


def _shift(rows: slice | None, offset: int, size: int) -> slice:
    """Rows of a sub-projection inside a fused tensor (None: all `size` of them)."""
    start, stop = (0, size) if rows is None else (rows.start, rows.stop)
    return slice(offset + start, offset + stop)


def _qkv(spec: ModelArch, take: Take, p: str, rows: dict[str, slice | None], names: WeightNames,
         kind: str) -> torch.Tensor:
    """The q, k, v rows (this rank's) of the weight or bias, as one tensor."""
    if names.fused_qkv is None:
        return torch.cat([take(p + f"self_attn.{n}_proj.{kind}", rows[n]) for n in "qkv"])
    name = f"{p}{names.fused_qkv}.{kind}"
    if all(r is None for r in rows.values()):
        return take(name)
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    offsets = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
    return torch.cat([take(name, _shift(rows[n], *offsets[n])) for n in "qkv"])


def _gate_up(spec: ModelArch, take: Take, p: str, mlp: slice | None, names: WeightNames
             ) -> torch.Tensor:
    if names.fused_gate_up is None:
        return torch.cat([take(p + "mlp.gate_proj.weight", mlp),
                          take(p + "mlp.up_proj.weight", mlp)])
    name = f"{p}{names.fused_gate_up}.weight"
    if mlp is None:
        return take(name)
    inter = spec.intermediate_size
    return torch.cat([take(name, _shift(mlp, 0, inter)), take(name, _shift(mlp, inter, inter))])


def _load(spec: ModelArch, take: Take, shard: TPShard | None, has_lm_head: bool,
          names: WeightNames) -> ModelWeights:
    q = kv = mlp = vocab = None
    if shard is not None:
        q, kv, mlp = shard.q_rows(), shard.kv_rows(), shard.mlp_rows()
        vocab = slice(*shard.vocab_range)
    layers = []
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        rows = {"q": q, "k": kv, "v": kv}
        qkv = _qkv(spec, take, p, rows, names, "weight")
        bias = _qkv(spec, take, p, rows, names, "bias") if spec.qkv_bias else None
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=qkv,
                qkv_bias=bias,
                o_proj=take(p + "self_attn.o_proj.weight", None, q),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=_gate_up(spec, take, p, mlp, names),
                down=take(p + "mlp.down_proj.weight", None, mlp),
                extra={n: take(f"{p}{n}.weight") for n in names.extra},
            )
        )
    embed = take("embed_tokens.weight", vocab)
    if spec.tie_word_embeddings or not has_lm_head:
        lm_head = embed
    else:
        lm_head = take("lm_head.weight", vocab)
    if shard is not None:  # every rank's logits one shape: the last shard's padding is zeros
        embed, lm_head = (_pad_rows(embed, shard.vocab_per_rank),
                          _pad_rows(lm_head, shard.vocab_per_rank))
        if spec.tie_word_embeddings or not has_lm_head:
            lm_head = embed
    return ModelWeights(embed=embed, layers=layers, final_norm=take("norm.weight"), lm_head=lm_head)
