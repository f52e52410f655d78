"""Reading safetensors weights into the fused layout the forward pass uses.

Owns: name mapping from HF checkpoints (q/k/v fused into qkv, gate/up fused into gate_up, or
read fused where the checkpoint stores them so: Phi-3's qkv_proj / gate_up_proj; a family's
extra per-layer tensors such as QK-norms and Gemma's feed-forward norms: WeightNames),
dtype/device placement, the loading progress bar, and reading only a tensor-parallel rank's
slices (tp_shard.py says which); a MoE model's sparse layers read through
layers/moe_weights.py (either expert layout, this rank's experts). A pre-quantized checkpoint's linear layers (those its
QuantConfig, from config.json's quantization_config, covers) are read as QWeights by
quantization/formats.py and sliced as their float weights would be; quantized tensors are
never cast to float silently. Does not know: the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from radixserve.model.arch import ModelArch
from radixserve.model.layers.moe import MoEWeights
from radixserve.model.layers.moe_spec import moe_of
from radixserve.model.layers.moe_weights import expert_part, load_moe_weights
from radixserve.model.quantization.config import QuantConfig
from radixserve.model.quantization.formats import read_qweight
from radixserve.model.quantization.qweight import LinearWeight, QWeight
from radixserve.model_source import ModelLoadError

if TYPE_CHECKING:
    from radixserve.model.tp_shard import TPShard


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (hidden,)
    # A linear weight: float (out, in), or a quantized checkpoint's projections (one QWeight
    # each, in output order: q, k, v or gate, up), which QuantLinear stacks where it can.
    qkv: LinearWeight  # ((heads + 2 * kv_heads) * head_dim, hidden)
    qkv_bias: torch.Tensor | None  # ((heads + 2 * kv_heads) * head_dim,)
    o_proj: LinearWeight  # (hidden, heads * head_dim)
    post_norm: torch.Tensor  # (hidden,)
    gate_up: LinearWeight | None  # (2 * intermediate, hidden); None: a sparse (MoE) layer
    down: LinearWeight | None  # (hidden, intermediate)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # WeightNames.extra's
    moe: MoEWeights | None = None  # a sparse layer's router and stacked experts


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


# Where a multimodal checkpoint (Gemma3ForConditionalGeneration) keeps its language model:
# as released and as transformers saves it, "language_model.model.*" and
# "language_model.lm_head.*"; with the model classes' own names (some re-saved checkpoints),
# "model.language_model.*" beside a top-level lm_head. The vision tower and projector keep
# their own names and are never read.
_TEXT_MODEL_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")


def text_model_name(key: str) -> str:
    """A checkpoint key as the text model's name, without "model." (the names _load reads)."""
    for prefix in _TEXT_MODEL_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key.removeprefix("model.")


class _Checkpoint:
    """The checkpoint's tensors by the text model's names (text_model_name), read one at a
    time, whole or one slice of rows/columns (a tensor-parallel rank reads only its shard)."""

    def __init__(self, hf_dir: Path, stack: ExitStack) -> None:
        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{hf_dir}: no *.safetensors weights (only safetensors are "
                                 "loaded)")
        self.hf_dir = hf_dir
        self.where: dict[str, tuple[Any, str]] = {}  # name -> (open file, key)
        for f in files:
            sf = stack.enter_context(safe_open(str(f), framework="pt"))
            self.where.update((text_model_name(k), (sf, k)) for k in sf.keys())

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
    names: WeightNames = WeightNames(), quant: QuantConfig | None = None,
) -> ModelWeights:
    """The model's weights (`names`: the family's checkpoint names); with `shard`, only that
    tensor-parallel rank's slices (model/tp_shard.py), the vocabulary shard padded to
    vocab_per_rank rows; with `quant`, the linear layers it covers as QWeights (on the CPU:
    the model's linear method moves them)."""
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
            out = t.to(device=device, dtype=dtype).contiguous()
            # NOTE: a no-op .to() leaves the weight in the checkpoint's private file mapping
            # (4 KB page-cache pages, which THP cannot advise): own anonymous memory instead
            return out.clone() if out.data_ptr() == t.data_ptr() else out

        def raw(name: str) -> torch.Tensor:
            bar.update(1)
            return ckpt.read(name)

        def qtake(module: str, rows: slice | None = None, cols: slice | None = None
                  ) -> QWeight | None:
            scheme = None if quant is None else quant.scheme_for(module)
            if scheme is None:
                return None
            return read_qweight(raw, ckpt.where.__contains__, module, scheme).rows(rows).cols(
                cols)

        return _load(spec, _Readers(take, qtake), shard, ckpt.where.keys(), names)


Take = Callable[..., torch.Tensor]  # (name, rows=None, cols=None) -> tensor
# (module, rows=None, cols=None) -> its QWeight, or None where it is stored unquantized
QTake = Callable[..., QWeight | None]


@dataclass(frozen=True)
class _Readers:
    take: Take
    qtake: QTake

    def __call__(self, name: str, rows: slice | None = None, cols: slice | None = None
                 ) -> torch.Tensor:
        return self.take(name, rows, cols)

    def part(self, module: str, rows: slice | None = None, cols: slice | None = None
             ) -> torch.Tensor | QWeight:
        """One projection's weight: its QWeight where quantized, else the float tensor."""
        q = self.qtake(module, rows, cols)
        return self.take(module + ".weight", rows, cols) if q is None else q

    def linear(self, parts: list[torch.Tensor | QWeight], what: str) -> LinearWeight:
        """Projections of one input fused: float rows concatenated, or the QWeights."""
        floats = [p for p in parts if isinstance(p, torch.Tensor)]
        if len(floats) == len(parts):
            return torch.cat(floats)
        if floats:
            raise ModelLoadError(f"{what}: some of its projections are quantized and some are "
                                 "not; fused projections must share one scheme")
        return [p for p in parts if isinstance(p, QWeight)]


def _shift(rows: slice | None, offset: int, size: int) -> slice:
    """Rows of a sub-projection inside a fused tensor (None: all `size` of them)."""
    start, stop = (0, size) if rows is None else (rows.start, rows.stop)
    return slice(offset + start, offset + stop)


def _qkv_bias(spec: ModelArch, take: Take, p: str, rows: dict[str, slice | None],
              names: WeightNames) -> torch.Tensor:
    """The q, k, v rows (this rank's) of the bias, as one tensor."""
    if names.fused_qkv is None:
        return torch.cat([take(p + f"self_attn.{n}_proj.bias", rows[n]) for n in "qkv"])
    name = f"{p}{names.fused_qkv}.bias"
    if all(r is None for r in rows.values()):
        return take(name)
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    offsets = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
    return torch.cat([take(name, _shift(rows[n], *offsets[n])) for n in "qkv"])


def _qkv(spec: ModelArch, read: _Readers, p: str, rows: dict[str, slice | None],
         names: WeightNames) -> LinearWeight:
    """The q, k, v rows (this rank's) of the weight, fused."""
    if names.fused_qkv is None:
        return read.linear([read.part(p + f"self_attn.{n}_proj", rows[n]) for n in "qkv"],
                           p + "self_attn")
    name = p + names.fused_qkv
    if all(r is None for r in rows.values()):
        return read.linear([read.part(name)], name)
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    offsets = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
    return read.linear([read.part(name, _shift(rows[n], *offsets[n])) for n in "qkv"], name)


def _gate_up(spec: ModelArch, read: _Readers, p: str, mlp: slice | None, names: WeightNames
             ) -> LinearWeight:
    if names.fused_gate_up is None:
        return read.linear([read.part(p + "mlp.gate_proj", mlp),
                            read.part(p + "mlp.up_proj", mlp)], p + "mlp")
    name = p + names.fused_gate_up
    if mlp is None:
        return read.linear([read.part(name)], name)
    inter = spec.intermediate_size
    return read.linear([read.part(name, _shift(mlp, 0, inter)),
                        read.part(name, _shift(mlp, inter, inter))], name)


def _load(spec: ModelArch, take: _Readers, shard: TPShard | None, stored: Collection[str],
          names: WeightNames) -> ModelWeights:
    q = kv = mlp = vocab = None
    if shard is not None:
        q, kv, mlp = shard.q_rows(), shard.kv_rows(), shard.mlp_rows()
        vocab = slice(*shard.vocab_range)
    has_lm_head = "lm_head.weight" in stored
    moe = moe_of(spec)
    part = None
    if moe is not None:  # which experts (and which slice of each) this rank holds
        part = expert_part(moe) if shard is None else shard.expert_part()
    layers = []
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        rows = {"q": q, "k": kv, "v": kv}
        experts = None
        if moe is not None and part is not None and moe.is_sparse(i):
            experts = load_moe_weights(take, stored, p, moe, part, take.qtake)
        sparse = experts is not None
        qkv = _qkv(spec, take, p, rows, names)
        bias = _qkv_bias(spec, take, p, rows, names) if spec.qkv_bias else None
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=qkv,
                qkv_bias=bias,
                o_proj=take.linear([take.part(p + "self_attn.o_proj", None, q)], "o_proj"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=None if sparse else _gate_up(spec, take, p, mlp, names),
                down=None if sparse else take.linear(
                    [take.part(p + "mlp.down_proj", None, mlp)], "down_proj"),
                extra={n: take(f"{p}{n}.weight") for n in names.extra},
                moe=experts,
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
