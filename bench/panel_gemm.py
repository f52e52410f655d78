"""The panel GEMM against oneDNN's, per CPU tier, dtype and row count, decode to prefill.

A stack of --layers decoder layers' linear weights in SmolLM2-135M's shapes (qkv 960 x 576,
o 576 x 576, gate and up 1536 x 576 each, down 576 x 1536; 10 layers: 141 MB in fp32, far past
the L3), multiplied layer after layer as a decode step does, so the weights come from memory.
Per row count M: ms per pass over the stack and the weights' GB/s, for
- panel: model/panel_kernel.py's op on the packed panels (the gate and up pair as its gated
  form, the residual adds as its epilogue), the float linears' default,
- onednn packed: `mkldnn._linear_pointwise` on weights reordered once (`_reorder_linear_weight`,
  the path before the panel op, and where it does not build) with the same epilogues,
- F.linear: torch's GEMM on the plain weights (the path where oneDNN lacks the dtype).
The weights (plain and packed) sit in 2 MB pages as the engine's do (--pages 4k: the heap's
4 KB pages, the engine before it advised them). Each tier runs in its own process with $RADIXSERVE_CPU_ISA and oneDNN's / ATen's dispatch
capped alike (bench/decode_floor.py's caps); the variants alternate within each round.

    python -m bench.panel_gemm --num-threads 2 --tiers avx2,avx512,avx512_bf16
    python -m bench.panel_gemm --rows 1,8,16,128,512 --dtypes bfloat16
    python -m bench.panel_gemm --num-threads 1 --clock cpu   # on a shared, loaded machine

Does not know: the engine (bench/decode_floor.py measures whole decode steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.decode_floor import ATEN_ISA, ONEDNN_ISA
from radixserve.model.panel_kernel import load_panel_op, pack, pack_gated
from radixserve.model.weight_memory import place_weights
from radixserve.platform.cpu_isa import ENV_CPU_ISA

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate": (1536, 576), "up": (1536, 576),
          "down": (576, 1536)}


def variants(layers: list[dict[str, torch.Tensor]], pages: str
             ) -> dict[str, Callable[[torch.Tensor], None]]:
    """`pages` "2m": every weight (plain and packed) advised into 2 MB pages, as the engine's
    are (model/weight_memory.py); "4k": left in the heap's 4 KB pages."""
    op = load_panel_op()
    assert op is not None, "the panel op did not build"
    lp = torch.ops.mkldnn._linear_pointwise
    try:
        packed = [{n: torch.ops.mkldnn._reorder_linear_weight(w, 32) for n, w in layer.items()}
                  for layer in layers]
    except RuntimeError:  # no bf16 reorder below AVX-512 (the model then runs F.linear)
        packed = []
    panels = [{"qkv": pack(w["qkv"], op.width), "o": pack(w["o"], op.width),
               "gate_up": pack_gated(w["gate"], w["up"], op.width),
               "down": pack(w["down"], op.width)} for w in layers]
    if pages == "2m":
        place_weights([layers, packed, panels])
    hidden, inter = SHAPES["o"][0], SHAPES["gate"][0]

    def panel(x: torch.Tensor) -> None:
        for w in panels:
            op.linear(x, w["qkv"], SHAPES["qkv"][0], None, None, False)
            op.linear(x, w["o"], hidden, None, x, False)
            act = op.linear(x, w["gate_up"], inter, None, None, True)
            op.linear(act, w["down"], hidden, None, x, False)

    def onednn(ws: list[dict[str, torch.Tensor]]) -> Callable[[torch.Tensor], None]:
        def run(x: torch.Tensor) -> None:
            for w in ws:
                lp(x, w["qkv"], None, "none", [], "")
                lp.binary(x, x, w["o"], None, "add")
                act = lp(x, w["gate"], None, "swish", [], "")
                act = lp.binary(x, act, w["up"], None, "mul")
                lp.binary(act, x, w["down"], None, "add")
        return run

    assert hidden == SHAPES["down"][0] and inter == SHAPES["down"][1]
    def torch_linear(x: torch.Tensor) -> None:
        for w in layers:
            F.linear(x, w["qkv"])
            x + F.linear(x, w["o"])
            act = F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"])
            x + F.linear(act, w["down"])

    out: dict[str, Callable[[torch.Tensor], None]] = {"panel": panel, "F.linear": torch_linear}
    if packed:
        out["onednn packed"] = onednn(packed)
    return out


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtypes)
    g = torch.Generator().manual_seed(0)
    layers = [{n: (torch.randn(*s, generator=g) * 0.05).to(dtype) for n, s in SHAPES.items()}
              for _ in range(args.layers)]
    nbytes = sum(w.numel() * w.element_size() for layer in layers for w in layer.values())
    runs = variants(layers, args.pages)
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, SHAPES["o"][1], generator=g).to(dtype)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for name, fn in list(runs.items()):
            try:
                fn(x)  # warm up (oneDNN creates its primitives)
            except RuntimeError:  # oneDNN without this dtype at this tier
                del runs[name], times[name]
        now = time.thread_time if args.clock == "cpu" else time.perf_counter
        for _ in range(args.reps):
            for name, fn in runs.items():
                t = now()
                fn(x)
                times[name].append(now() - t)
        for name, ts in times.items():
            s = statistics.median(ts)
            print(json.dumps({"tier": args.tiers, "dtype": args.dtypes, "rows": m,
                              "variant": name, "ms": s * 1e3, "gbs": nbytes / s / 1e9}),
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tiers", default="avx2,avx512,avx512_bf16")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rows", default="1,2,4,8,16,64,256,512")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the main thread's CPU time (needs --num-threads 1)")
    ap.add_argument("--pages", choices=("2m", "4k"), default="2m",
                    help="the weights in 2 MB pages (as the engine's) or the heap's 4 KB")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.clock == "cpu" and args.num_threads != 1:
        ap.error("--clock cpu needs --num-threads 1: other threads' work is not counted")
    if args.worker:
        worker(args)
        return
    print(f"{'tier':12s} {'dtype':9s} {'rows':>4s} {'variant':14s} {'ms':>8s} {'GB/s':>6s}")
    for tier in args.tiers.split(","):
        env = {**os.environ, ENV_CPU_ISA: tier, "ONEDNN_MAX_CPU_ISA": ONEDNN_ISA[tier]}
        if tier in ATEN_ISA:
            env["ATEN_CPU_CAPABILITY"] = ATEN_ISA[tier]
        for dtype in args.dtypes.split(","):
            cmd = [sys.executable, "-m", "bench.panel_gemm", "--worker", "--tiers", tier,
                   "--dtypes", dtype, "--rows", args.rows, "--layers", str(args.layers),
                   "--reps", str(args.reps), "--num-threads", str(args.num_threads),
                   "--clock", args.clock, "--pages", args.pages]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            for line in done.stdout.splitlines():
                r = json.loads(line)
                print(f"{r['tier']:12s} {r['dtype']:9s} {r['rows']:4d} {r['variant']:14s} "
                      f"{r['ms']:8.2f} {r['gbs']:6.1f}", flush=True)


if __name__ == "__main__":
    main()
