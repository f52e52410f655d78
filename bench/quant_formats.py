"""Quantized-weight GEMMs on CPU, Llama-3.2-1B shape: resident bytes and speed against bf16.

One decoder layer's linear layers, side by side in one run.

    python -m bench.quant_formats                 # rows 1 and 512, median of 5
    python -m bench.quant_formats --rows 1 --runs 9
    RADIXSERVE_CPU_ISA=avx2 python -m bench.quant_formats --layers 4 --clock cpu --threads 1

Configs (weights random, round-to-nearest): bf16 (the model's own path: oneDNN-prepacked
bf16 Linear), w4a16 (int4, group 128, asymmetric: AWQ / GPTQ / compressed-tensors W4A16),
fp8 (per-channel e4m3: `--quantization fp8`, compressed-tensors FP8-dynamic), fp8-block
(128 x 128 scales: DeepSeek / Qwen3-FP8), each through QuantLinear's native kernel, and
dequant-mm: the same int4 weight dequantized to bf16 then F.linear on every call (what a
kernel-less path costs). Activations bf16. The four layers (qkv 3072 x 2048, o 2048 x 2048,
gate_up 16384 x 2048, down 2048 x 8192) run in turn, configs interleaved run by run so that
load on a shared machine hits all alike; the figure is the median time of one layer's four
GEMMs and the ratio to bf16's. `--layers L` holds L copies of the layer (distinct weights) and
times them in turn: a decode step streams its weights from memory, and one layer's int4
weights (34 MB) would otherwise be partly served from a large L3 cache. The native kernels
run at the process's CPU tier ($RADIXSERVE_CPU_ISA caps it; bf16 is oneDNN's own choice).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixserve.model.cpu_linear import Linear
from radixserve.model.quantization.cpu_kernel import load_quant_gemm
from radixserve.model.quantization.linear import QuantLinear
from radixserve.model.quantization.qweight import QWeight, quantize_fp8, quantize_int
from radixserve.platform.cpu_isa import choose_tier

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192)}
CPU = torch.device("cpu")
Layer = Callable[[torch.Tensor], torch.Tensor]


def _fp8_block(w: torch.Tensor) -> QWeight:
    """Block 128 x 128 scales as the canonical (N, K / 128) per-row expansion."""
    q = quantize_fp8(w, 128)
    n = w.shape[0]
    block_max = q.scale.view(-1, 128, q.scale.shape[1]).amax(dim=1)  # (N / 128, G)
    rows = block_max.repeat_interleave(128, 0)[:n]
    return quantize_fp8_with(w, rows)


def quantize_fp8_with(w: torch.Tensor, scale: torch.Tensor) -> QWeight:
    from radixserve.model.quantization.qweight import Kind, to_fp8_codes

    idx = torch.arange(w.shape[1]) // 128
    return QWeight(Kind.FP8, to_fp8_codes(w / scale[:, idx]), scale.contiguous(), None, 128)


def build(name: str, w: torch.Tensor) -> tuple[Layer, int]:
    gemm = load_quant_gemm()
    if name == "bf16":
        lin = Linear(w.bfloat16())
        return lin, lin.nbytes
    if name == "dequant-mm":
        q = quantize_int(w, 4, 128, symmetric=False)
        ql = QuantLinear([q], None, CPU, None)
        return (lambda x: F.linear(x, q.dequantize().to(x.dtype))), ql.nbytes
    q = {"w4a16": lambda: quantize_int(w, 4, 128, symmetric=False),
         "fp8": lambda: quantize_fp8(w), "fp8-block": lambda: _fp8_block(w)}[name]()
    ql = QuantLinear([q], None, CPU, gemm)
    return ql, ql.nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,512")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--configs", default="bf16,w4a16,fp8,fp8-block,dequant-mm")
    ap.add_argument("--layers", type=int, default=1,
                    help="copies of the layer, timed in turn (figures: per layer)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (time.process_time), which a machine "
                         "shared with other jobs inflates far less than wall time; use it "
                         "with --threads 1 (idle OpenMP workers spin and count)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    names = args.configs.split(",")
    gen = torch.Generator().manual_seed(0)
    copies = [{s: torch.randn(n, k, generator=gen) * 0.02 for s, (n, k) in SHAPES.items()}
              for _ in range(args.layers)]
    layers = {c: [{s: build(c, w) for s, w in ws.items()} for ws in copies] for c in names}
    print(f"threads {torch.get_num_threads()}, {args.clock} clock, CPU tier "
          f"{choose_tier().tier.value}; one decoder layer's linear layers, {args.layers} "
          f"cop{'y' if args.layers == 1 else 'ies'}")
    bf16_bytes = sum(b for _, b in layers["bf16"][0].values()) if "bf16" in layers else 0
    for c in names:
        nbytes = sum(b for _, b in layers[c][0].values())
        ratio = f"{nbytes / bf16_bytes:.3f}x bf16" if bf16_bytes else ""
        print(f"  {c:11s} resident {nbytes / 1e6:8.2f} MB  {ratio}")
    for m in map(int, args.rows.split(",")):
        xs = {s: torch.randn(m, k, generator=gen).bfloat16() for s, (_, k) in SHAPES.items()}
        times: dict[str, list[float]] = {c: [] for c in names}
        for _ in range(args.runs + 1):  # the first run warms up
            for c in names:
                t0 = clock()
                for layer in layers[c]:
                    for s, (fn, _) in layer.items():
                        fn(xs[s])
                times[c].append((clock() - t0) / args.layers)
        base = statistics.median(times["bf16"][1:]) if "bf16" in times else None
        for c in names:
            med = statistics.median(times[c][1:])
            vs = f"  {base / med:5.2f}x bf16's speed" if base else ""
            print(f"  rows {m:4d}  {c:11s} {med * 1e3:9.2f} ms{vs}")


if __name__ == "__main__":
    main()
