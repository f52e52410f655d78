"""Fused elementwise kernels against the unfused torch ops they replace in a decoder layer.

Owns: the three comparisons (residual add + RMSNorm, RoPE + KV store, SiLU * up) at the
Llama-1B shape (hidden 2048, 32/8 heads of 64, intermediate 8192) for several token counts:
time per call (CUDA events, median), kernel launches per call (torch.profiler) and the
largest difference from the unfused result. The timed fused RoPE includes a copy of qkv
(its input is rotated in place; a decoder layer has no such copy), counted in its launches. Does not know: the engine or the model.

    python -m bench.fused_kernels                 # on a CUDA GPU
    python -m bench.fused_kernels --interpret     # anywhere: tiny correctness pass (no timings)

NOTE: triton_kernels is imported inside functions, after --interpret has set TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from bench.common.interpret import turn_on_interpreter
from bench.kernels import time_ms
from radixserve.model.arch import RopeSpec
from radixserve.model.norm_rope import rms_norm_reference, rope_qk_reference
from radixserve.model.rope import RotaryTable

HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INTER = 2048, 32, 8, 64, 8192
Op = Callable[[], object]


class Case(NamedTuple):
    name: str
    fused: Op
    unfused: Op
    outputs: Callable[[], tuple[torch.Tensor, torch.Tensor]]  # (fused's, unfused's) result


def launches(fn: Op, device: torch.device) -> int:
    """GPU kernels one call launches (profiler's device-side events)."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return len([e for e in prof.events() if e.device_type == DeviceType.CUDA])


def cases(tokens: int, dtype: torch.dtype, device: torch.device) -> list[Case]:
    from triton_kernels import fused_add_rmsnorm, rope_qk_store, silu_mul, store_kv

    gen = torch.Generator().manual_seed(tokens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)

    x, res, w = randn(tokens, HIDDEN), randn(tokens, HIDDEN), randn(HIDDEN)
    work = [x.clone(), res.clone()]  # the fused op's in-place operands, timed repeatedly

    def norm_unfused() -> torch.Tensor:
        return rms_norm_reference(x + res, w, 1e-5)  # the residual add, then 6-8 ops

    def norm_outputs() -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rmsnorm(x.clone(), res.clone(), w, 1e-5), norm_unfused()

    table = RotaryTable(RopeSpec(theta=500000.0), HEAD_DIM, 4096, dtype, device)
    pos = torch.randint(0, 4096, (tokens,), generator=gen).to(device)
    qkv = randn(tokens, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)
    slots = torch.randperm(2 * tokens, generator=gen)[:tokens].to(device)
    caches = [torch.zeros(2 * tokens, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
              for _ in range(4)]

    def rope_fused() -> None:  # on a copy: rotating qkv in place twice would rotate twice
        rope_qk_store(qkv.clone(), table.cos, table.sin, pos, Q_HEADS, caches[0], caches[1],
                      slots)

    def rope_unfused() -> None:
        c, s = table.lookup(pos)
        qk = rope_qk_reference(qkv, c, s, Q_HEADS + KV_HEADS)  # (T, q + kv heads, D)
        v = qkv[:, (Q_HEADS + KV_HEADS) * HEAD_DIM :].view(-1, KV_HEADS, HEAD_DIM)
        store_kv(caches[2], caches[3], qk[:, Q_HEADS:], v, slots)

    def rope_outputs() -> tuple[torch.Tensor, torch.Tensor]:
        rope_fused()
        rope_unfused()
        return caches[0][slots], caches[2][slots]

    gate_up = randn(tokens, 2 * INTER)

    def silu_unfused() -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    return [
        Case("add+rmsnorm", lambda: fused_add_rmsnorm(work[0], work[1], w, 1e-5), norm_unfused,
             norm_outputs),
        Case("rope+store", rope_fused, rope_unfused, rope_outputs),
        Case("silu*up", lambda: silu_mul(gate_up), silu_unfused,
             lambda: (silu_mul(gate_up), silu_unfused())),
    ]


def run(token_counts: list[int], dtype: torch.dtype, device: torch.device, iters: int
        ) -> list[float]:
    """Print the table; returns each row's largest |fused - unfused|."""
    diffs = []
    timed = device.type == "cuda"
    print(f"{'op':<13}{'tokens':>7}{'fused us':>10}{'unfused us':>11}{'speedup':>8}"
          f"{'launches':>10}{'max diff':>10}")
    for tokens in token_counts:
        for c in cases(tokens, dtype, device):
            if timed:
                fused_us, unfused_us = time_ms(c.fused, iters) * 1e3, time_ms(c.unfused, iters) * 1e3
                counts = f"{launches(c.fused, device)} vs {launches(c.unfused, device)}"
                speed = f"{unfused_us / fused_us:.2f}x"
            else:
                fused_us = unfused_us = float("nan")
                counts, speed = "-", "-"
            got, want = c.outputs()
            diff = (got.float() - want.float()).abs().max().item()
            diffs.append(diff)
            print(f"{c.name:<13}{tokens:>7}{fused_us:>10.1f}{unfused_us:>11.1f}{speed:>8}"
                  f"{counts:>10}{diff:>10.1e}")
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--interpret", action="store_true",
                        help="tiny correctness pass on CPU through Triton's interpreter")
    parser.add_argument("--tokens", default="1,64,256,4096", help="token counts, comma-separated")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=100, help="timed runs per op")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.interpret:
        if not turn_on_interpreter():
            return 1
        run([1, 3], dtype, torch.device("cpu"), 0)
        return 0
    if not torch.cuda.is_available():
        print("bench.fused_kernels needs a CUDA GPU (use --interpret for a CPU correctness pass)")
        return 0
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}, {args.dtype}, Llama-1B shape")
    run([int(t) for t in args.tokens.split(",")], dtype, device, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
