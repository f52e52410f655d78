"""Matmul kernels for SmolLM2-135M's linear shapes, timed: why quant.py chooses as it does.

fp32 and bf16 (plain and oneDNN-prepacked),
int8 weight-only (`_weight_int8pack_mm`, fp32 or bf16 activations), int8 x int8 (`_int_mm`
with per-row dynamic activation quantization: faster on VNNI, but not what the engine runs,
since it costs agreement with fp32), the project's native weight-only int8 GEMM
(model/int8_kernel.py on its packed weight, fp32 activations; column w8native). Why
model/quant.py and model/auto_dtype.py choose what they choose.

    python -m bench.quant_kernels                    # 1 thread, rows 1,32,2048, 30 layers
    python -m bench.quant_kernels --rows 1,2,4,8 --layers 8
    python -m bench.quant_kernels --skip w8a32,w8a16,w8a8  # model/cpu_linear.py's choice

Each timing runs every layer's QKV, O, gate_up and down once (distinct weights, so that
decode reads them from memory as a real step does), best-of-3 medians; ratios against fp32.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from radixserve.model.int8_kernel import load_int8_gemm, pack_int8_weight
from radixserve.model.quant import QMAX, Int8Weight, quantize_per_channel

Kernel = Callable[[torch.Tensor], torch.Tensor]
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def timed(fn: Callable[[], None], reps: int) -> float:
    fn()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - start) / reps)
    return statistics.median(runs)


def kernels(layers: int, gen: torch.Generator) -> dict[str, list[tuple[str, Kernel]]]:
    """kernel name -> [(shape name, fn(x fp32) -> y)] over `layers` distinct weights per shape."""
    out: dict[str, list[tuple[str, Kernel]]] = {k: [] for k in (
        "fp32", "fp32-packed", "bf16", "bf16-packed", "w8a32", "w8a16", "w8a8", "w8native")}
    native = load_int8_gemm()
    for name, (n, k) in SHAPES.items():
        for _ in range(layers):
            w = torch.randn(n, k, generator=gen) * 0.02
            wb = w.bfloat16()
            packed = torch.ops.mkldnn._reorder_linear_weight(wb, 32)
            packed32 = torch.ops.mkldnn._reorder_linear_weight(w, 32)
            q = quantize_per_channel(w)
            scale_bf16 = q.scale.bfloat16()
            out["fp32"].append((name, partial(F.linear, weight=w)))
            out["fp32-packed"].append((name, partial(_packed, p=packed32)))
            out["bf16"].append((name, partial(F.linear, weight=wb)))
            out["bf16-packed"].append((name, partial(_packed, p=packed)))
            out["w8a32"].append((name, partial(_w8, q=q.qweight, s=q.scale)))
            out["w8a16"].append((name, partial(_w8, q=q.qweight, s=scale_bf16)))
            out["w8a8"].append((name, partial(_w8a8, q=q)))
            if native is not None:
                out["w8native"].append((name, partial(_native, op=native,
                                                      p=pack_int8_weight(q.qweight), q=q)))
    return out


def _packed(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    return y


def _w8(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x, q, s)
    return y


def _native(x: torch.Tensor, op: Callable[..., torch.Tensor], p: torch.Tensor,
            q: Int8Weight) -> torch.Tensor:
    return op(x, p, q.scale, q.qweight.shape[0])


def _w8a8(x: torch.Tensor, q: Int8Weight) -> torch.Tensor:
    """Dynamic symmetric per-row int8 activations times the int8 weight (VNNI), rescaled."""
    xs = (x.abs().amax(dim=1, keepdim=True) / QMAX).clamp_min(1e-12)  # (M, 1)
    xq = torch.round(x / xs).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch._int_mm(xq, q.qweight.t()).to(torch.float32).mul_(xs).mul_(q.scale)


def _runner(fns: list[tuple[str, Kernel]], inputs: dict[str, torch.Tensor]
            ) -> Callable[[], None]:
    def run() -> None:
        for shape, f in fns:
            f(inputs[shape])
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,32,2048")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip", default="", help="kernels to skip, e.g. w8a32 (very slow at 2048)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ks = kernels(args.layers, torch.Generator().manual_seed(0))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {n: torch.randn(rows, k) for n, (_, k) in SHAPES.items()}
        xb = {n: x.bfloat16() for n, x in xs.items()}
        reps = 1 if rows >= 1024 else 5
        res = {}
        for kname, fns in ks.items():
            if kname in args.skip.split(",") or not fns:
                continue
            inputs = xb if kname in ("bf16", "bf16-packed", "w8a16") else xs
            res[kname] = timed(_runner(fns, inputs), reps)
        base = res["fp32"]
        print(f"rows={rows}, {args.layers} layers, {args.threads} thread(s): " + ", ".join(
            f"{k} {v * 1e3:.1f} ms ({base / v:.2f}x)" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
