"""Decode attention over a paged KV pool: the torch cascade vs the native CPU kernel, side by side.

One decode step's attention through every layer (the store of the new K/V included), as the
model runs it: B requests, each with a distinct prompt of --prompt-len tokens (consecutive
slots, as one prefill gets them) and --decoded tokens generated so far (their slots
interleaved across requests, as a decode step hands them out), SmolLM2-135M's heads
(9 query, 3 KV, head_dim 64) and 30 layers. Paths, run alternately in the same process:
- torch: TorchAttentionBackend() (gathers each request's keys into a padded block per layer,
  then one fused flash call with a mask);
- native: TorchAttentionBackend(load_paged_decode()) (keys read in place through the slot
  table by csrc/paged_decode.cpp).
Prints the median ms per step of each and their ratio, the median of the rounds' own ratios
(each round runs the paths back to back), and the largest difference. `--clock cpu` times
process CPU time instead of wall time (on a machine shared with other jobs, wall time moves
with their load and CPU time much less; use it with --num-threads 1, where no thread waits
for another).
`--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2` compares instead the native kernel over a pool in the
model's dtype (auto) with the same kernel over the 8-bit pool holding the same K/V (quantized
with per-head scales), side by side; `--layers` shrinks the pools (each layer's step is alike).
`--new-tokens N` (N > 1, at most SHORT_QUERY_MAX) makes it the step that verifies drafts: N
new tokens per request, causal among themselves, one kernel row per token on the native path.
`--window W` compares instead the native kernel attending the whole context with the same kernel
under a sliding window of W tokens (attention/base.py's `window`: each request's start raised
to seq_len - W), on the same pool: the work the window saves at long context.

    python -m bench.decode_attention --batch 32 --prompt-len 516 --decoded 24 --dtype float32
    python -m bench.decode_attention --new-tokens 4 --dtype bfloat16 --num-threads 2
    python -m bench.decode_attention --kv-cache-dtype fp8 --prompt-len 4072 --dtype bfloat16 \
        --num-threads 2 --layers 8
    python -m bench.decode_attention --kv-cache-dtype fp8 --prompt-len 4072 --dtype bfloat16 \
        --num-threads 1 --layers 4 --clock cpu
    python -m bench.decode_attention --window 1024 --prompt-len 8168 --batch 8 --layers 8 \
        --dtype bfloat16 --num-threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from radixserve.attention.base import AttentionMetadata
from radixserve.attention.cpu_kernels import load_paged_decode
from radixserve.attention.kv_quant import KV_DTYPES, KVScale, quantize, scales_from_amax
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.types import Phase

HQ, HKV, D = 9, 3, 64


def decode_meta(batch: int, prompt_len: int, decoded: int, new: int = 1
                ) -> tuple[AttentionMetadata, int]:
    """Metadata of the step that adds tokens decoded .. decoded + new - 1 to every request;
    and the slots used."""
    prefix = prompt_len + decoded
    seq = prefix + new
    table = torch.zeros(batch, seq, dtype=torch.int32)
    base = batch * prompt_len
    for b in range(batch):
        table[b, :prompt_len] = torch.arange(b * prompt_len, (b + 1) * prompt_len)
        table[b, prompt_len:] = base + torch.arange(decoded + new) * batch + b
    n = torch.full((batch,), new, dtype=torch.int32)
    rows = torch.arange(batch)
    meta = AttentionMetadata(
        phase=Phase.DECODE if new == 1 else Phase.PREFILL, slot_table=table, rows=rows,
        prefix_lens=torch.full((batch,), prefix, dtype=torch.int32), extend_lens=n,
        seq_lens=torch.full((batch,), seq, dtype=torch.int32),
        cu_extend=torch.arange(batch + 1, dtype=torch.int32) * new,
        out_slots=table[:, prefix:].flatten().long(), prefix_lens_cpu=(prefix,) * batch,
        extend_lens_cpu=(new,) * batch, max_seq_len=seq, max_extend_len=new,
        rows_cpu=tuple(range(batch)))
    return meta, base + (decoded + new) * batch


class Pool:
    """One path's K/V (layers, slots, Hkv, D) and, for an 8-bit pool, its scales per layer."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, kv_dtype: torch.dtype | None) -> None:
        self.scales: list[KVScale | None] = [None] * k.shape[0]
        if kv_dtype is not None:
            ks = scales_from_amax(k.abs().amax(dim=(1, 3)), kv_dtype)  # (layers, Hkv)
            vs = scales_from_amax(v.abs().amax(dim=(1, 3)), kv_dtype)
            self.scales = [KVScale(ks[i], vs[i]) for i in range(k.shape[0])]
            k = torch.stack([quantize(k[i], ks[i], kv_dtype) for i in range(k.shape[0])])
            v = torch.stack([quantize(v[i], vs[i], kv_dtype) for i in range(v.shape[0])])
        self.k, self.v = k, v


def step(backend: TorchAttentionBackend, qkv: list[torch.Tensor], pool: Pool,
         meta: AttentionMetadata, clock: Callable[[], float], window: int | None = None
         ) -> tuple[float, torch.Tensor]:
    t = clock()
    out = torch.empty(0)
    for i in range(pool.k.shape[0]):
        q, kn, vn = torch.split(qkv[i], [HQ, HKV, HKV], dim=1)  # Tensor.split is unannotated
        out = backend.forward(q, kn, vn, pool.k[i], pool.v[i], meta, D**-0.5, pool.scales[i],
                              window=window)
    return clock() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=516)
    ap.add_argument("--decoded", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=1,
                    help="new tokens per request (> 1: a verify step, drafts of N - 1)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="wall time, or this process's CPU time")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_DTYPES],
                    help="not auto: native kernel over the model-dtype pool vs the 8-bit pool")
    ap.add_argument("--window", type=int, default=None,
                    help="native kernel over the whole context vs with this sliding window")
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    kernel = load_paged_decode()
    assert kernel is not None, "the native kernel did not build (see the warning above)"
    meta, slots = decode_meta(args.batch, args.prompt_len, args.decoded, args.new_tokens)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(args.layers, slots, HKV, D, generator=g).to(dtype)
    v = torch.randn(args.layers, slots, HKV, D, generator=g).to(dtype)
    T = args.batch * args.new_tokens
    qkv = [torch.randn(T, HQ + 2 * HKV, D, generator=g).to(dtype) for _ in range(args.layers)]
    native = TorchAttentionBackend(kernel)
    windows: dict[str, int | None] = {}
    if args.window is not None:
        pool = Pool(k, v, None if args.kv_cache_dtype == "auto"
                    else KV_DTYPES[args.kv_cache_dtype])
        paths = {"native, full context": (native, pool),
                 f"native, window {args.window}": (native, pool)}
        windows[f"native, window {args.window}"] = args.window
    elif args.kv_cache_dtype == "auto":
        paths = {"torch cascade": (TorchAttentionBackend(), Pool(k, v, None)),
                 "native kernel": (native, Pool(k, v, None))}
    else:
        paths = {f"native, {args.dtype} pool": (native, Pool(k, v, None)),
                 f"native, {args.kv_cache_dtype} pool": (
                     native, Pool(k, v, KV_DTYPES[args.kv_cache_dtype]))}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in paths}
    outs: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for _ in range(args.runs + 1):  # the first round warms up
            for name, (backend, pool) in paths.items():
                secs, outs[name] = step(backend, qkv, pool, meta, clock, windows.get(name))
                times[name].append(secs)
    med = [statistics.median(ts[1:]) * 1e3 for ts in times.values()]
    first, second = outs.values()
    diff = (first.float() - second.float()).abs().max().item()
    print(f"decode attention, {args.layers} layers, batch {args.batch} x {args.new_tokens} new, "
          f"context {meta.max_seq_len} tokens, {args.dtype}, {args.num_threads} thread(s), "
          f"{args.clock} time, median of {args.runs}:")
    base = list(times.values())[0][1:]
    for name, ms in zip(times, med, strict=True):
        rounds = statistics.median(t / b for t, b in zip(times[name][1:], base, strict=True))
        print(f"{name:24s} {ms:8.1f} ms/step   ({med[0] / ms:.2f}x; time ratio {ms / med[0]:.2f},"
              f" per round {rounds:.2f})")
    if args.window is None:  # (a window changes the output: no difference to compare)
        print(f"max |difference| of the last layer's output: {diff:.2e}")


if __name__ == "__main__":
    main()
