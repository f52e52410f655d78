"""Tiny random Llamas written in each quantized checkpoint format, beside their dequantized
float twin (what HF transformers runs as the reference).

Owns: the formats' writers, following the formats' own packing code: AutoAWQ's
WQLinear_GEMM (int32 words along the output dim, nibble i holding column 8c + [0, 2, 4, 6,
1, 3, 5, 7][i]), AutoGPTQ's pack (inputs along qweight's rows, zero - 1 stored in v1),
compressed-tensors' pack_to_int32 (value + 2^(bits-1), the lowest bits first, along the
input dim; zero points along the output dim) and the FP8 formats (block `weight_scale_inv`,
per-tensor `weight_scale`). Does not know: radixserve's readers (they are what is tested).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from radixserve.model.quantization.qweight import FP8_MAX, quantize_fp8, quantize_int

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        "qkv_proj", "gate_up_proj",  # these two: fused in the checkpoint (Phi-3)
        "w1", "w2", "w3")  # Mixtral's experts (a MoE router, `*.gate`, stays in float)
# llm-compressor's MoE recipes leave the routers out, as vLLM expects
ROUTERS = ("re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_words(codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
               ) -> torch.Tensor:
    """Unsigned codes -> int32 words of 32 / bits codes along `dim` (value j of a word at bits
    j * bits; `order`: word slot i holds element order[i] of its run, AWQ's interleave)."""
    per = 32 // bits
    c = codes.to(torch.int64)
    if dim == 0:
        return pack_words(c.t(), bits, 1, order).t().contiguous()
    pad = (-c.shape[1]) % per
    c = torch.nn.functional.pad(c, (0, pad)).view(c.shape[0], -1, per)
    if order is not None:
        c = c[:, :, list(order)]
    words = torch.zeros(c.shape[:2], dtype=torch.int64)
    for i in range(per):
        words |= c[:, :, i] << (bits * i)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # as two's complement int32


def _fp8_block(w: torch.Tensor, bn: int, bk: int) -> tuple[dict[str, torch.Tensor],
                                                           torch.Tensor]:
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w, (0, gk * bk - k, 0, gn * bn - n))
    scale = padded.view(gn, bn, gk, bk).abs().amax(dim=(1, 3)) / FP8_MAX  # (gn, gk)
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # (N, K)
    q = (w / full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * full


def _fp8_tensor(w: torch.Tensor, static: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = w.abs().amax() / FP8_MAX
    q = (w / scale).to(torch.float8_e4m3fn)
    out = {"weight": q, "weight_scale": scale.reshape(())}
    if static:
        out["input_scale"] = torch.tensor(0.05)
    return out, q.float() * scale


def _ct(w: torch.Tensor, opts: dict[str, Any]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    fmt = opts["format"]
    if fmt == "float-quantized":
        qw = quantize_fp8(w)
        return {"weight": qw.codes.view(torch.float8_e4m3fn), "weight_scale": qw.scale
                }, qw.dequantize()
    bits, group, sym = opts["bits"], opts.get("group", -1), opts.get("symmetric", True)
    qw = quantize_int(w, bits, group if group > 0 else w.shape[1], sym)
    assert qw.zero is not None
    if fmt == "naive-quantized":
        return {"weight": (qw.codes.to(torch.int16) - 128).to(torch.int8),
                "weight_scale": qw.scale, "weight_zero_point":
                (qw.zero - 128).to(torch.int8)}, qw.dequantize()
    out = {"weight_packed": pack_words(qw.codes, bits, 1), "weight_scale": qw.scale,
           "weight_shape": torch.tensor(list(w.shape))}
    if not sym:
        out["weight_zero_point"] = pack_words(qw.zero.to(torch.int64), bits, 0)
    return out, qw.dequantize()


def _awq(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    qw = quantize_int(w, 4, group, symmetric=False)
    assert qw.zero is not None
    scale16 = qw.scale.half()
    deq = (qw.codes.float() - qw.zero.repeat_interleave(group, 1)) * \
        scale16.float().repeat_interleave(group, 1)
    return {"qweight": pack_words(qw.codes.t(), 4, 1, AWQ_ORDER),
            "qzeros": pack_words(qw.zero.t().to(torch.int64), 4, 1, AWQ_ORDER),
            "scales": scale16.t().contiguous()}, deq


def _gptq(w: torch.Tensor, opts: dict[str, Any], seed: int) -> tuple[dict[str, torch.Tensor],
                                                                      torch.Tensor]:
    bits, group, sym = opts["bits"], opts["group"], opts.get("sym", True)
    n, k = w.shape
    order = torch.arange(k)
    if opts.get("desc_act"):
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)  # column order[i] in group i // g
    qw = quantize_int(w[:, order], bits, group, sym)
    assert qw.zero is not None
    codes = torch.empty_like(qw.codes)
    codes[:, order] = qw.codes
    scale16 = qw.scale.half()
    gi = g_idx.long()
    deq = (codes.float() - qw.zero[:, gi]) * scale16.float()[:, gi]
    stored_zero = (qw.zero.to(torch.int64) - 1) & ((1 << bits) - 1)  # v1: zero - 1
    return {"qweight": pack_words(codes.t().contiguous(), bits, 0),
            "qzeros": pack_words(stored_zero.t().contiguous(), bits, 1),
            "scales": scale16.t().contiguous(), "g_idx": g_idx}, deq


def quant_config(method: str, opts: dict[str, Any]) -> dict[str, Any]:
    if method == "fp8":
        cfg: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3",
                               "activation_scheme": opts.get("activation", "dynamic")}
        if "block" in opts:
            cfg["weight_block_size"] = list(opts["block"])
        return cfg
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": opts["group"], "version": "gemm",
                "zero_point": True, "modules_to_not_convert": opts.get("skip")}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": opts["bits"], "group_size": opts["group"],
                "sym": opts.get("sym", True), "desc_act": bool(opts.get("desc_act"))}
    fmt, bits = opts["format"], opts.get("bits", 8)
    kind = "float" if fmt == "float-quantized" else "int"
    group = opts.get("group", -1)
    weights = {"num_bits": bits, "type": kind, "symmetric": opts.get("symmetric", True),
               "strategy": "group" if group > 0 else "channel", "dynamic": False,
               "group_size": group if group > 0 else None}
    act = ({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
            "symmetric": True} if kind == "float" else None)
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": act}},
            "ignore": ["lm_head", *ROUTERS, *opts.get("skip", [])]}


def _encode(method: str, w: torch.Tensor, opts: dict[str, Any], seed: int
            ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    if method == "fp8":
        if "block" in opts:
            return _fp8_block(w, *opts["block"])
        return _fp8_tensor(w, opts.get("activation") == "static")
    if method == "awq":
        return _awq(w, opts["group"])
    if method == "gptq":
        return _gptq(w, opts, seed)
    return _ct(w, opts)


def write_quantized(src: Path, dst: Path, method: str, **opts: Any) -> tuple[Path, Path]:
    """(quantized folder, dequantized float32 folder) of the tiny model in `src`.
    `skip`: projection names (e.g. "down_proj") left in float (ignore lists)."""
    state = load_file(str(src / "model.safetensors"))
    quant: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for seed, (name, t) in enumerate(sorted(state.items())):
        proj = name.split(".")[-2] if name.endswith(".weight") else ""
        if proj not in PROJ or proj in opts.get("skip", ()):
            quant[name] = deq[name] = t
            continue
        tensors, w = _encode(method, t.float(), opts, seed)
        prefix = name.removesuffix(".weight")
        quant.update({f"{prefix}.{k}": v.contiguous() for k, v in tensors.items()})
        deq[name] = w.to(t.dtype).contiguous()
    out = (dst / f"{method}-q", dst / f"{method}-deq")
    for folder, tensors in zip(out, (quant, deq), strict=True):
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out[0] / "config.json").read_text())
    cfg["quantization_config"] = quant_config(method, opts)
    (out[0] / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
