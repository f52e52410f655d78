"""The CPU MoE layer's cost: where its time goes (routing, grouping, scatter vs the GEMMs).

Owns: a random MoE layer in the issue's shape (hidden 1024, 32 experts, top-4, expert width
512), timing the whole block and its expert GEMMs alone on the same grouping, and the report.
Does not know: the engine or the rest of the model.

    python -m bench.moe_layer                 # fp32 and bf16, batch 1, 16, 64
    python -m bench.moe_layer --batch 64 --dtype bf16 --reps 30
    python -m bench.moe_layer --threads 1 --clock cpu   # on a machine shared with others
    python -m bench.moe_layer --quant w4a16 fp8 --batch 1 16 --threads 1 --clock cpu

"non-GEMM share" = the median over rounds of 1 - (the experts alone) / (the whole block), the
two timed in turn in each round (a shared machine's load hits both). With the native op
(model/moe_kernel.py) "the experts alone" is the op on the block's routing: its grouping (a
counting sort) and its per-token sum are inside it, so what the share counts is the routing
(router linear, softmax, top-k) and the residual add; on the torch path (`--torch`, or no
build) it is the expert GEMM loop on a precomputed grouping, and the share adds the sort, the
row gather, the weighting and the index_add scatter. `torch path ms`: the same layer on the
torch path (oneDNN-prepacked experts, one GEMM pair per active expert), timed alike.
`--quant`: the bf16 layer against the same experts quantized (W4A16 group 128, FP8 per
channel) on the native quantized op: `--layers` layers per step (8: the issue's real-ish
model), the input changing each step so that the routing does (the experts stream from
memory as in decode, not from a cache a fixed routing keeps warm), timed in turn per round,
with each one's expert bytes.
Also printed: the same layer's expert weights read per step, against a dense gated MLP of the
active width (top_k * expert width), timed alike, to show that a step touches only the
experts it routes to.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from radixserve.model.cpu_linear import GatedMLP
from radixserve.model.layers.moe import (
    MoEBlock,
    MoEWeights,
    Routing,
    expert_gemms,
    group_by_expert,
    route,
)
from radixserve.model.layers.moe_quant import QuantExperts
from radixserve.model.layers.moe_spec import MoESpec
from radixserve.model.quantization.experts import quantize_experts_fp8, quantize_experts_int

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _interleaved_ms(fns: list[Callable[[], object]], reps: int,
                    clock: Callable[[], float] = time.perf_counter) -> list[list[float]]:
    """Each fn's times (ms) over `reps` rounds, the fns run in turn within a round: under a
    shared machine's load they see the same conditions, so their ratio per round is fair."""
    for fn in fns:
        fn()
        fn()  # warm: oneDNN primitives, allocator
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times, strict=True):
            t0 = clock()
            fn()
            ts.append((clock() - t0) * 1e3)
    return times


def _weights(spec: MoESpec, hidden: int, dtype: torch.dtype, seed: int = 0) -> MoEWeights:
    g = torch.Generator().manual_seed(seed)
    e, f = spec.num_experts, spec.expert_size

    def w(*shape: int) -> torch.Tensor:
        t: torch.Tensor = torch.randn(*shape, generator=g) * shape[-1] ** -0.5
        return t.to(dtype)

    return MoEWeights(router=w(e, hidden), gate_up=w(e, 2 * f, hidden), down=w(e, hidden, f))


def _layer(spec: MoESpec, hidden: int, dtype: torch.dtype, native: bool) -> MoEBlock:
    return MoEBlock(spec, _weights(spec, hidden, dtype), native=native)


def _quant_layer(spec: MoESpec, hidden: int, fmt: str, seed: int) -> MoEBlock:
    """A layer of _weights(seed) (bf16 router; fmt "bf16": the float layer on the native op)
    with its experts quantized round-to-nearest: w4a16 (int4, groups of 128, symmetric:
    compressed-tensors' W4A16) or fp8 (per channel: --quantization fp8), on the native
    quantized op (layers/moe_quant.py)."""
    if fmt == "bf16":
        return MoEBlock(spec, _weights(spec, hidden, torch.bfloat16, seed))
    w = _weights(spec, hidden, torch.float32, seed)
    assert isinstance(w.gate_up, torch.Tensor) and isinstance(w.down, torch.Tensor)
    if fmt == "fp8":
        gu, dn = quantize_experts_fp8(w.gate_up), quantize_experts_fp8(w.down)
    else:
        gu, dn = (quantize_experts_int(t, 4, 128) for t in (w.gate_up, w.down))
    experts = QuantExperts(gu, dn, spec.num_experts, 0, fused=False)
    assert experts.op is not None, "the native op did not build"
    return MoEBlock(spec, MoEWeights(w.router.bfloat16(), gu, dn), quant=experts)


def _steps(layers: list[MoEBlock], xs: list[torch.Tensor]) -> Callable[[], object]:
    """One call: the next input through every layer (the inputs, so the routing, change from
    call to call as decode steps' do: the experts' weights come from memory, not a cache
    that a fixed routing would keep warm)."""
    state = {"i": 0}

    def step() -> object:
        h = xs[state["i"] % len(xs)]
        state["i"] += 1
        for layer in layers:
            h = layer(h, h)
        return h

    return step


def measure_quant(batch: int, reps: int, spec: MoESpec, hidden: int, formats: list[str],
                  clock: Callable[[], float] = time.perf_counter, num_layers: int = 1
                  ) -> dict[str, float]:
    """`num_layers` layers of bf16 experts (native op) and of each quantized format on the
    same bf16 inputs, timed in turn per round; medians (ms per step) and expert bytes."""
    names = ["bf16", *formats]
    stacks = [[_quant_layer(spec, hidden, f, seed) for seed in range(num_layers)]
              for f in names]
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(batch, hidden, generator=gen).bfloat16() for _ in range(16)]
    times = _interleaved_ms([_steps(layers, xs) for layers in stacks], reps, clock)
    out: dict[str, float] = {"batch": batch}
    for name, layers, ts in zip(names, stacks, times, strict=True):
        out[f"{name}_ms"] = statistics.median(ts)
        out[f"{name}_bytes"] = sum(b.nbytes - b.router.nbytes for b in layers)
    return out


def _report_quant(args: argparse.Namespace, spec: MoESpec,
                  clock: Callable[[], float]) -> None:
    fmts = args.quant
    print(f"quantized experts vs bf16 (bf16 activations, the native op each), {args.layers} "
          "layers, inputs varying per step; ms per step, (x): bf16's time / this one's")
    print(f"{'batch':>5} {'bf16 ms':>9} " + " ".join(f"{f + ' ms':>10} {'(x)':>6}"
                                                     for f in fmts))
    for batch in args.batch:
        r = measure_quant(batch, args.reps, spec, args.hidden, fmts, clock, args.layers)
        cells = " ".join(f"{r[f + '_ms']:10.3f} {r['bf16_ms'] / r[f + '_ms']:6.2f}"
                         for f in fmts)
        print(f"{batch:>5} {r['bf16_ms']:9.3f} {cells}")
    print("expert bytes: " + ", ".join(
        f"{f} {r[f + '_bytes'] / 2**20:.1f} MiB ({r[f + '_bytes'] / r['bf16_bytes']:.3f}x)"
        for f in ["bf16", *fmts]))


def _experts_alone(block: MoEBlock, x: torch.Tensor, routing: Routing,
                   num_experts: int) -> Callable[[], object]:
    """The block's expert compute without the routing: the native op, or the torch path's
    GEMM loop on a precomputed grouping."""
    native, gate_up, down = block.native, block.gate_up, block.down
    if native is not None:
        assert gate_up is not None and down is not None
        return lambda: native(x, routing.weights, routing.expert_ids, gate_up, down, 0)
    groups = group_by_expert(routing.expert_ids, num_experts, 0, num_experts)
    rows = x.index_select(0, groups.token_rows)
    return lambda: expert_gemms(rows, groups.counts, gate_up, down, block.packed)


def measure(batch: int, dtype: torch.dtype, reps: int, spec: MoESpec, hidden: int,
            clock: Callable[[], float] = time.perf_counter, native: bool = True
            ) -> dict[str, float]:
    block = _layer(spec, hidden, dtype, native)
    torch_block = _layer(spec, hidden, dtype, native=False)
    x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    routing = route(x, block.router, spec.top_k, spec.renormalize)
    groups = group_by_expert(routing.expert_ids, spec.num_experts, 0, spec.num_experts)
    active = spec.top_k * spec.expert_size
    gu = (torch.randn(2 * active, hidden) * hidden**-0.5).to(dtype)
    dn = (torch.randn(hidden, active) * active**-0.5).to(dtype)
    dense = GatedMLP(gu, dn)
    total, alone, torch_ms, dense_ms = _interleaved_ms(
        [lambda: block(x, x), _experts_alone(block, x, routing, spec.num_experts),
         lambda: torch_block(x, x), lambda: dense(x, x)], reps, clock)
    share = statistics.median(1 - g / t for g, t in zip(alone, total, strict=True))
    return {"batch": batch, "block_ms": statistics.median(total),
            "experts_ms": statistics.median(alone), "non_gemm_share": share,
            "torch_ms": statistics.median(torch_ms),
            "active_experts": sum(1 for c in groups.counts if c),
            "dense_active_ms": statistics.median(dense_ms), "native": block.native is not None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--dtype", choices=list(DTYPES), nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-size", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--quant", nargs="+", choices=["w4a16", "fp8"], default=None,
                    help="instead: the bf16 layer against its experts quantized (W4A16 "
                         "group 128, FP8 per channel), side by side")
    ap.add_argument("--layers", type=int, default=8,
                    help="--quant: layers per step (their experts together outgrow the caches)")
    ap.add_argument("--torch", action="store_true",
                    help="the block on the torch path (not the native op)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (time.process_time), which a machine "
                         "shared with other jobs inflates far less than wall time; use it "
                         "with --threads 1 (idle OpenMP workers spin and count)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    spec = MoESpec(num_experts=args.experts, top_k=args.top_k, expert_size=args.expert_size,
                   renormalize=True)
    print(f"MoE layer: hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, "
          f"expert width {args.expert_size}; threads {torch.get_num_threads()}, "
          f"{args.clock} clock, median of {args.reps}")
    if args.quant:
        _report_quant(args, spec, clock)
        return
    print(f"{'dtype':>5} {'batch':>5} {'block ms':>9} {'experts ms':>10} {'non-GEMM':>9} "
          f"{'torch path ms':>13} {'experts':>7} {'dense(active) ms':>16}")
    for name in args.dtype:
        for batch in args.batch:
            r = measure(batch, DTYPES[name], args.reps, spec, args.hidden, clock,
                        native=not args.torch)
            print(f"{name:>5} {batch:>5} {r['block_ms']:9.3f} {r['experts_ms']:10.3f} "
                  f"{r['non_gemm_share']:9.1%} {r['torch_ms']:13.3f} "
                  f"{int(r['active_experts']):>7} {r['dense_active_ms']:16.3f}")
    print("block: " + ("the native op" if r["native"] else "the torch path"))

if __name__ == "__main__":
    main()
