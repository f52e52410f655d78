"""Kernel micro-benchmark: each Triton kernel against a torch baseline, checked and timed.

Owns: the benchmark shapes, the torch baselines (index_put for the store, SDPA over K/V
gathered through the slot table for attention), timing with CUDA events, and the report.
Does not know: the engine or the model.

    python -m bench.kernels              # on a CUDA GPU: check + time at realistic sizes
    python -m bench.kernels --interpret  # anywhere: tiny correctness pass through Triton's
                                         # CPU interpreter (no timings)

Bandwidth is counted in *useful* bytes (K/V of the attended tokens, q, out, slot indices)
for the kernel and the baseline alike, so the two GB/s columns compare directly; the baseline
also moves its gathered copy of K/V, which is why it is slower.
NOTE: triton_kernels is imported inside functions, after --interpret has set TRITON_INTERPRET
(it must be set before triton is first imported).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from bench.common.interpret import turn_on_interpreter


@dataclass(frozen=True)
class Shape:
    batch: int
    prefix_len: int  # cached tokens per request before this forward
    extend_len: int  # new tokens per request (decode: 1)
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads {self.q_heads} not a multiple of kv_heads {self.kv_heads}")

    @property
    def seq_len(self) -> int:
        return self.prefix_len + self.extend_len


GPU_DECODE = Shape(64, 4095, 1, 32, 8, 128, 16, torch.bfloat16)
GPU_EXTEND = Shape(8, 2048, 512, 32, 8, 128, 16, torch.bfloat16)
CPU_DECODE = Shape(3, 99, 1, 6, 2, 64, 16, torch.float32)
CPU_EXTEND = Shape(2, 37, 20, 6, 2, 64, 16, torch.float32)


class Inputs(NamedTuple):
    q: torch.Tensor  # (B * extend_len, q_heads, head_dim)
    k_cache: torch.Tensor  # (num_slots, kv_heads, head_dim), every request's KV stored
    v_cache: torch.Tensor
    slot_table: torch.Tensor  # (B, seq_len) int32, pages in shuffled order
    rows: torch.Tensor  # (B,) int64
    prefix_lens: torch.Tensor  # (B,) int32
    extend_lens: torch.Tensor  # (B,) int32
    seq_lens: torch.Tensor  # (B,) int32
    cu_extend: torch.Tensor  # (B + 1,) int32


class Result(NamedTuple):
    name: str
    ms: float
    gbps: float
    tflops: float
    baseline_ms: float
    baseline_gbps: float
    rel_err: float


def make_inputs(s: Shape, device: torch.device) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(0)
    pages_per_req = -(-s.seq_len // s.page_size)
    num_pages = s.batch * pages_per_req
    order = torch.randperm(num_pages, device=device, generator=gen)
    pages = order.view(s.batch, pages_per_req)  # (B, pages_per_req)
    offs = torch.arange(s.page_size, device=device)
    slots = (pages[:, :, None] * s.page_size + offs).flatten(1)[:, : s.seq_len]  # (B, seq_len)
    shape = (num_pages * s.page_size, s.kv_heads, s.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=s.dtype, generator=gen)
    v_cache = torch.randn(shape, device=device, dtype=s.dtype, generator=gen)
    q = torch.randn((s.batch * s.extend_len, s.q_heads, s.head_dim), device=device,
                    dtype=s.dtype, generator=gen)

    def full(value: int) -> torch.Tensor:
        return torch.full((s.batch,), value, dtype=torch.int32, device=device)

    cu = torch.arange(s.batch + 1, dtype=torch.int32, device=device) * s.extend_len
    return Inputs(q, k_cache, v_cache, slots.int().contiguous(),
                  torch.arange(s.batch, device=device), full(s.prefix_len), full(s.extend_len),
                  full(s.seq_len), cu)


def gather_kv(x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    slots = x.slot_table.long()  # (B, L)
    return x.k_cache[slots].transpose(1, 2), x.v_cache[slots].transpose(1, 2)  # (B, Hkv, L, D)


def decode_baseline(x: Inputs, scale: float) -> torch.Tensor:
    keys, values = gather_kv(x)
    out = F.scaled_dot_product_attention(x.q.unsqueeze(2), keys, values, scale=scale,
                                         enable_gqa=True)  # (B, Hq, 1, D)
    return out.squeeze(2)


def extend_baseline(x: Inputs, s: Shape, scale: float) -> torch.Tensor:
    keys, values = gather_kv(x)
    q = x.q.view(s.batch, s.extend_len, s.q_heads, s.head_dim).transpose(1, 2)  # (B, Hq, E, D)
    q_pos = torch.arange(s.prefix_len, s.seq_len, device=q.device)
    mask = torch.arange(s.seq_len, device=q.device)[None, :] <= q_pos[:, None]  # (E, L)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)  # (B, Hq, E, D)
    return out.transpose(1, 2).reshape(-1, s.q_heads, s.head_dim)


def time_ms(fn: Callable[[], object], iters: int) -> float:
    """Median of `iters` CUDA-event timings after warm-up (compiles, autotunes, caches)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def attention_bytes(s: Shape) -> int:
    elt = torch.finfo(s.dtype).bits // 8
    kv = 2 * s.batch * s.seq_len * s.kv_heads * s.head_dim * elt
    q_out = 2 * s.batch * s.extend_len * s.q_heads * s.head_dim * elt
    return kv + q_out + s.batch * s.seq_len * 4  # + the slot indices


def attention_flops(s: Shape) -> int:
    visible = sum(s.prefix_len + j + 1 for j in range(s.extend_len))  # keys per request
    return 4 * s.batch * visible * s.q_heads * s.head_dim  # QK^T and PV, 2 flops per MAC


def run_case(name: str, s: Shape, device: torch.device, iters: int) -> Result:
    from triton_kernels import decode_attention, extend_attention, store_kv

    x = make_inputs(s, device)
    scale = s.head_dim**-0.5
    kernel: Callable[[], torch.Tensor]
    baseline: Callable[[], torch.Tensor]
    nbytes, flops = attention_bytes(s), attention_flops(s)
    if name == "store_kv":
        slots = x.slot_table[:, s.prefix_len :].flatten().long()  # this forward's slots
        k = torch.randn((slots.shape[0], s.kv_heads, s.head_dim), device=device, dtype=s.dtype)
        caches = (x.k_cache.clone(), x.v_cache.clone())

        def store_with_kernel() -> torch.Tensor:
            store_kv(caches[0], caches[1], k, k, slots)
            return caches[0]

        def store_with_index_put() -> torch.Tensor:
            x.k_cache[slots] = k
            x.v_cache[slots] = k
            return x.k_cache

        kernel, baseline = store_with_kernel, store_with_index_put
        elt = torch.finfo(s.dtype).bits // 8
        nbytes, flops = 4 * k.numel() * elt + slots.numel() * 8, 0  # read + write, K and V
    elif s.extend_len == 1:
        kernel = lambda: decode_attention(x.q, x.k_cache, x.v_cache, x.slot_table, x.rows,
                                          x.seq_lens, scale)
        baseline = lambda: decode_baseline(x, scale)
    else:
        kernel = lambda: extend_attention(x.q, x.k_cache, x.v_cache, x.slot_table, x.rows,
                                          x.prefix_lens, x.extend_lens, x.cu_extend,
                                          s.extend_len, scale)
        baseline = lambda: extend_baseline(x, s, scale)
    err = rel_err(kernel(), baseline())
    if device.type != "cuda":
        return Result(name, float("nan"), float("nan"), float("nan"), float("nan"),
                      float("nan"), err)
    ms, base_ms = time_ms(kernel, iters), time_ms(baseline, iters)
    return Result(name, ms, nbytes / ms / 1e6, flops / ms / 1e9, base_ms, nbytes / base_ms / 1e6,
                  err)


def report(results: list[Result], shapes: dict[str, Shape], tol: float) -> bool:
    """Print one line per kernel (timings are '-' when not measured); True if all match."""

    def num(value: float, spec: str) -> str:
        return "-" if math.isnan(value) else format(value, spec)

    print(f"{'kernel':<18}{'ms':>8}{'GB/s':>7}{'TFLOP/s':>8}{'base ms':>8}{'base GB/s':>10}"
          f"{'speedup':>8}{'rel err':>9}  shape")
    ok = True
    for r in results:
        s = shapes[r.name]
        passed = r.rel_err <= tol
        ok = ok and passed
        shape = (f"B={s.batch} prefix={s.prefix_len} new={s.extend_len} "
                 f"heads={s.q_heads}/{s.kv_heads} d={s.head_dim} page={s.page_size} "
                 f"{str(s.dtype).removeprefix('torch.')}")
        print(f"{r.name:<18}{num(r.ms, '.3f'):>8}{num(r.gbps, '.0f'):>7}"
              f"{num(r.tflops, '.1f'):>8}{num(r.baseline_ms, '.3f'):>8}"
              f"{num(r.baseline_gbps, '.0f'):>10}{num(r.baseline_ms / r.ms, '.2f'):>7}x"
              f"{r.rel_err:>9.1e}  {shape} {'ok' if passed else 'MISMATCH'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--interpret", action="store_true",
                        help="tiny correctness pass on CPU through Triton's interpreter")
    parser.add_argument("--iters", type=int, default=50, help="timed runs per kernel")
    args = parser.parse_args(argv)
    if args.interpret:
        if not turn_on_interpreter():
            return 1
        device = torch.device("cpu")
        decode, extend, tol = CPU_DECODE, CPU_EXTEND, 1e-5
    elif not torch.cuda.is_available():
        print("bench.kernels needs a CUDA GPU (use --interpret for a CPU correctness pass)")
        return 0
    else:
        device = torch.device("cuda")
        decode, extend, tol = GPU_DECODE, GPU_EXTEND, 2e-2
        print(f"device: {torch.cuda.get_device_name(device)}")
    shapes = {"store_kv (decode)": decode, "store_kv (extend)": extend,
              "decode_attention": decode, "extend_attention": extend}
    results = [run_case("store_kv" if name.startswith("store_kv") else name, s, device,
                        args.iters)._replace(name=name) for name, s in shapes.items()]
    return 0 if report(results, shapes, tol) else 1


if __name__ == "__main__":
    sys.exit(main())
