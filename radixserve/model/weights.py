"""Reading safetensors weights into the fused layout the forward pass uses.

Owns: name mapping from HF checkpoints (q/k/v fused into qkv, gate/up fused into gate_up),
dtype/device placement, the loading progress bar, and reading only a tensor-parallel rank's
slices (tp_shard.py says which). A pre-quantized checkpoint's linear layers (the
QuantConfig of config.json's quantization_config) are read as QWeights by
quantization/formats.py, sliced as their float weights would be. Does not know: the forward
pass.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from radixserve.model.arch import ModelArch
from radixserve.model.quantization.config import QuantConfig
from radixserve.model.quantization.formats import read_qweight
from radixserve.model.quantization.qweight import QWeight
from radixserve.model_source import ModelLoadError

if TYPE_CHECKING:
    from radixserve.model.tp_shard import TPShard


# A linear layer's weight: float (N, K), or a quantized checkpoint's projections (one QWeight
# each, in output order: q, k, v or gate, up), which QuantLinear stacks where it can.
LinearWeight = torch.Tensor | list[QWeight]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (hidden,)
    qkv: LinearWeight  # ((heads + 2 * kv_heads) * head_dim, hidden)
    qkv_bias: torch.Tensor | None  # ((heads + 2 * kv_heads) * head_dim,)
    o_proj: LinearWeight  # (hidden, heads * head_dim)
    post_norm: torch.Tensor  # (hidden,)
    gate_up: LinearWeight  # (2 * intermediate, hidden)
    down: LinearWeight  # (hidden, intermediate)


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
    show_progress: bool = True, shard: TPShard | None = None, quant: QuantConfig | None = None,
) -> ModelWeights:
    """The model's weights; with `shard`, only that tensor-parallel rank's slices
    (model/tp_shard.py), the vocabulary shard padded to vocab_per_rank rows; with `quant`,
    the linear layers it quantizes as QWeights (on the CPU: the model moves them)."""
    with ExitStack() as stack:
        ckpt = _Checkpoint(hf_dir, stack)
        bar = stack.enter_context(tqdm(total=len(ckpt.where), desc="Loading weights",
                                       disable=not show_progress, leave=False))

        def take(name: str, rows: slice | None = None, cols: slice | None = None
                 ) -> torch.Tensor:
            bar.update(1)
            t = ckpt.read(name, rows, cols)
            if not t.is_floating_point() or t.element_size() == 1:  # never cast codes silently
                raise ModelLoadError(
                    f"{hf_dir}: weight {name!r} is stored quantized ({t.dtype}) but its "
                    "format is not read here (config.json's quantization_config does not "
                    "cover it)")
            return t.to(device=device, dtype=dtype).contiguous()

        def raw(name: str) -> torch.Tensor:
            bar.update(1)
            return ckpt.read(name)

        def linear(names: list[str], rows: list[slice | None], cols: slice | None = None
                   ) -> LinearWeight:
            schemes = {quant.scheme_for(n) for n in names} if quant is not None else {None}
            if len(schemes) > 1:
                raise ModelLoadError(f"{hf_dir}: {', '.join(names)} are quantized differently;"
                                     " they must share one scheme (they are fused)")
            scheme = schemes.pop()
            if scheme is None:
                return torch.cat([take(n + ".weight", r, cols)
                                  for n, r in zip(names, rows, strict=True)])
            return [read_qweight(raw, ckpt.where.__contains__, n, scheme).rows(r).cols(cols)
                    for n, r in zip(names, rows, strict=True)]

        return _load(spec, take, linear, shard, "lm_head.weight" in ckpt.where)


Take = Callable[..., torch.Tensor]  # (name, rows=None, cols=None) -> tensor
TakeLinear = Callable[..., LinearWeight]  # (names, rows per name, cols=None) -> weight


def _load(spec: ModelArch, take: Take, linear: TakeLinear, shard: TPShard | None,
          has_lm_head: bool) -> ModelWeights:
    q = kv = mlp = vocab = None
    if shard is not None:
        q, kv, mlp = shard.q_rows(), shard.kv_rows(), shard.mlp_rows()
        vocab = slice(*shard.vocab_range)
    layers = []
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        rows = {"q": q, "k": kv, "v": kv}
        qkv = linear([p + f"self_attn.{n}_proj" for n in "qkv"], [q, kv, kv])
        bias = None
        if spec.qkv_bias:
            bias = torch.cat([take(p + f"self_attn.{n}_proj.bias", rows[n]) for n in "qkv"])
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=qkv,
                qkv_bias=bias,
                o_proj=linear([p + "self_attn.o_proj"], [None], q),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=linear([p + "mlp.gate_proj", p + "mlp.up_proj"], [mlp, mlp]),
                down=linear([p + "mlp.down_proj"], [None], mlp),
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
