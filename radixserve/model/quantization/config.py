"""`quantization_config` (config.json) parsed into frozen per-format specs, validated at load.

Owns: which formats and options load (each unsupported option is a ModelLoadError naming it,
never a silent wrong load), and `scheme_for`, the per-linear answer "how is this layer's
weight stored" (a LinearScheme, or None: a plain float weight, e.g. a module in `ignore`).
Does not know: tensors, kernels, the model's layers beyond their checkpoint names.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.model_source import ModelLoadError


class Storage(enum.Enum):
    """How one linear layer's weight sits in the checkpoint."""
    FP8 = "fp8"  # float8_e4m3fn `weight` + `weight_scale` (tensor/channel) or `weight_scale_inv`
    AWQ = "awq"  # AutoAWQ GEMM: qweight (K, N/8), qzeros (K/g, N/8), scales (K/g, N)
    GPTQ = "gptq"  # qweight (K/pack, N), qzeros (K/g, N/pack), scales (K/g, N), g_idx (K,)
    CT_PACKED = "pack-quantized"  # weight_packed (N, K/pack) int32, weight_scale, zero point
    CT_NAIVE = "naive-quantized"  # `weight` int8 (N, K), weight_scale, weight_zero_point
    CT_FLOAT = "float-quantized"  # `weight` fp8 (N, K), weight_scale (tensor or channel)


@dataclass(frozen=True)
class LinearScheme:
    """One linear layer's stored format: enough to read and dequantize its tensors."""
    storage: Storage
    bits: int = 8
    group_size: int = -1  # along the input dim; -1: one group (per output channel)
    block: tuple[int, int] | None = None  # fp8 block scales: (rows, cols) per scale
    symmetric: bool = True
    zero_plus_one: bool = False  # GPTQ v1 checkpoints store zero - 1
    static_input_scale: bool = False  # an `input_scale` tensor sits beside the weight


@dataclass(frozen=True)
class QuantConfig:
    """The checkpoint's quantization: a default scheme, per-target overrides, exclusions."""
    method: str  # fp8 | awq | gptq | compressed-tensors
    default: LinearScheme | None
    targets: tuple[tuple[str, LinearScheme], ...] = ()  # (target, scheme), first match wins
    ignore: tuple[str, ...] = ()  # module names (or `re:` patterns) left in float

    def scheme_for(self, module: str) -> LinearScheme | None:
        """The scheme of linear `module` ("model.layers.0.self_attn.q_proj" or without
        "model."), or None when it is stored unquantized."""
        full = module if module.startswith("model.") or module == "lm_head" else "model." + module
        if any(_matches(p, full) for p in self.ignore):
            return None
        for target, scheme in self.targets:
            if target == "Linear" or _matches(target, full):
                return scheme
        return self.default


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    short = module.removeprefix("model.")
    # A plain name matches the module or any module it is a suffix of ("lm_head", "q_proj").
    return pattern in (module, short) or module.endswith("." + pattern) or (
        "." in pattern and (module.startswith(pattern + ".") or short.startswith(pattern + ".")))


def _err(method: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"quantization_config ({method}): {what} is not supported")


def _fp8(q: dict[str, Any]) -> QuantConfig:
    if q.get("fmt", "e4m3") != "e4m3":
        raise _err("fp8", f"fmt {q['fmt']!r} (only e4m3)")
    act = q.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise _err("fp8", f"activation_scheme {act!r}")
    block = q.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) <= 0):
        raise _err("fp8", f"weight_block_size {block!r}")
    scheme = LinearScheme(Storage.FP8, block=None if block is None else (int(block[0]),
                                                                         int(block[1])),
                          static_input_scale=act == "static")
    ignored = tuple(q.get("ignored_layers") or q.get("modules_to_not_convert") or ())
    return QuantConfig("fp8", scheme, ignore=ignored)


def _awq(q: dict[str, Any]) -> QuantConfig:
    bits = int(q.get("bits", q.get("w_bit", 4)))
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _err("awq", f"version {version!r} (only gemm)")
    if bits != 4:
        raise _err("awq", f"bits {bits} (only 4)")
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    zero = bool(q.get("zero_point", True))
    if not zero:
        raise _err("awq", "zero_point false")
    scheme = LinearScheme(Storage.AWQ, bits=4, group_size=group, symmetric=False)
    return QuantConfig("awq", scheme, ignore=tuple(q.get("modules_to_not_convert") or ()))


def _gptq(q: dict[str, Any]) -> QuantConfig:
    bits = int(q.get("bits", 4))
    if bits not in (4, 8):
        raise _err("gptq", f"bits {bits} (only 4 and 8)")
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _err("gptq", f"checkpoint_format {fmt!r}")
    if q.get("dynamic"):
        raise _err("gptq", "per-module `dynamic` overrides")
    scheme = LinearScheme(Storage.GPTQ, bits=bits, group_size=int(q.get("group_size", 128)),
                          symmetric=bool(q.get("sym", True)), zero_plus_one=fmt == "gptq")
    return QuantConfig("gptq", scheme, ignore=tuple(q.get("modules_to_not_convert") or ()))


def _ct_scheme(name: str, group: dict[str, Any], fmt: str) -> LinearScheme:
    w = group.get("weights")
    if not w:
        raise _err("compressed-tensors", f"config group {name!r} without `weights`")
    act = group.get("input_activations")
    kind, bits, strategy = w.get("type", "int"), int(w.get("num_bits", 8)), w.get("strategy")
    for key in ("actorder", "block_structure"):
        if w.get(key):
            raise _err("compressed-tensors", f"weights.{key} {w[key]!r} in group {name!r}")
    if w.get("dynamic"):
        raise _err("compressed-tensors", f"dynamic weights in group {name!r}")
    group_size = int(w.get("group_size") or -1) if strategy == "group" else -1
    if strategy not in ("tensor", "channel", "group"):
        raise _err("compressed-tensors", f"weights.strategy {strategy!r} in group {name!r}")
    if kind == "float":
        if fmt not in ("float-quantized", "naive-quantized") or bits != 8 or strategy == "group":
            raise _err("compressed-tensors", f"{bits}-bit float weights with strategy "
                       f"{strategy!r} and format {fmt!r} in group {name!r}")
        static = act is not None and not act.get("dynamic", True)
        if act is not None and (act.get("type", "float") != "float" or
                                act.get("num_bits", 8) != 8):
            raise _err("compressed-tensors", f"input_activations {act!r} in group {name!r}")
        return LinearScheme(Storage.CT_FLOAT, static_input_scale=static)
    if kind != "int":
        raise _err("compressed-tensors", f"weights.type {kind!r} in group {name!r}")
    if act is not None:
        raise _err("compressed-tensors", f"int weights with quantized input_activations "
                   f"(W{bits}A{act.get('num_bits')}) in group {name!r}")
    if fmt == "pack-quantized":
        if bits not in (4, 8):
            raise _err("compressed-tensors", f"{bits}-bit packed weights in group {name!r}")
        storage = Storage.CT_PACKED
    elif fmt in ("naive-quantized", "int-quantized"):
        if bits != 8:
            raise _err("compressed-tensors", f"{bits}-bit naive weights in group {name!r}")
        storage = Storage.CT_NAIVE
    else:
        raise _err("compressed-tensors", f"format {fmt!r} for int weights in group {name!r}")
    if strategy == "tensor" and storage is Storage.CT_PACKED:
        raise _err("compressed-tensors", f"strategy 'tensor' for packed weights in {name!r}")
    return LinearScheme(storage, bits=bits, group_size=group_size,
                        symmetric=bool(w.get("symmetric", True)))


def _compressed_tensors(q: dict[str, Any]) -> QuantConfig:
    if q.get("sparsity_config"):
        raise _err("compressed-tensors", "sparsity_config")
    if q.get("kv_cache_scheme"):
        raise _err("compressed-tensors", "kv_cache_scheme (use --kv-cache-dtype fp8)")
    fmt = q.get("format", "dense")
    targets: list[tuple[str, LinearScheme]] = []
    for name, group in (q.get("config_groups") or {}).items():
        scheme = _ct_scheme(name, group, group.get("format") or fmt)
        targets += [(t, scheme) for t in group.get("targets") or ["Linear"]]
    if not targets:
        raise _err("compressed-tensors", "a config without config_groups")
    return QuantConfig("compressed-tensors", None, tuple(targets),
                       tuple(q.get("ignore") or ()))


PARSERS = {"fp8": _fp8, "awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors}


def parse_quant_config(q: dict[str, Any]) -> QuantConfig:
    method = str(q.get("quant_method", "")).lower()
    if method not in PARSERS:
        raise ModelLoadError(f"quantization_config: quant_method {method!r} is not supported; "
                             f"supported: {', '.join(PARSERS)}")
    return PARSERS[method](q)


def read_quant_config(hf_dir: Path) -> QuantConfig | None:
    """The checkpoint's QuantConfig, or None when config.json has no quantization_config."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    q = cfg.get("quantization_config") or cfg.get("compression_config")
    return None if not q else parse_quant_config(q)


ONLINE_FP8 = QuantConfig("fp8", LinearScheme(Storage.FP8))  # `--quantization fp8` on a bf16 model


def resolve_quantization(flag: str | None, checkpoint: QuantConfig | None) -> str | None:
    """The load-time quantization to apply ("int8", "fp8" or None) given `--quantization` and
    the checkpoint's own; a flag that contradicts the checkpoint is a ModelLoadError."""
    if checkpoint is None:
        if flag not in (None, "int8", "fp8"):
            raise ModelLoadError(f"--quantization {flag}: the checkpoint has no "
                                 "quantization_config (only int8 and fp8 quantize at load)")
        return flag
    if flag not in (None, checkpoint.method):
        raise ModelLoadError(f"--quantization {flag}: the checkpoint is already quantized "
                             f"({checkpoint.method}); leave the flag out or pass "
                             f"{checkpoint.method}")
    return None
