"""Prefill attention of long extends: the torch path vs the native causal kernel.

The torch path (varlen.py's query chunks over torch's CPU
flash kernel) vs the native causal kernel (csrc/prefill_attention.cpp), side by side.

One prefill forward's attention through every layer (the store of the new K/V included), as
the model runs it: one request with --prefix cached tokens (scattered pool slots) and an
extend of --tokens new tokens, SmolLM2-135M's heads (9 query, 3 KV, head_dim 64) and 30
layers. Both paths run alternately in the same process; prints the median ms per forward of
each, their ratio and the largest difference between them.
`--window W` compares instead the native kernel attending causally over everything with the
same kernel under a sliding window of W tokens (only the prefix inside the first query's window
is read; key blocks before each query block's window are skipped).

    python -m bench.prefill_attention --tokens 516 --prefix 0 --dtype float32
    python -m bench.prefill_attention --tokens 2048 --prefix 2048 --dtype bfloat16
    python -m bench.prefill_attention --tokens 2048 --prefix 6144 --window 1024 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.decode_attention import HKV, HQ, D, Pool  # SmolLM2-135M shapes
from bench.decode_attention import step as forward  # LAYERS x backend.forward, timed
from radixserve.attention.base import AttentionMetadata
from radixserve.attention.cpu_kernels import load_prefill_attention
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.types import Phase

LAYERS = 30  # SmolLM2-135M's


def extend_meta(tokens: int, prefix: int) -> tuple[AttentionMetadata, int]:
    """Metadata of one extend of `tokens` after `prefix` cached tokens; and the slots used.
    The prefix's slots are a permutation (pages scattered in the pool), the extend's follow."""
    seq = prefix + tokens
    table = torch.zeros(1, seq, dtype=torch.int32)
    table[0, :prefix] = torch.randperm(prefix, generator=torch.Generator().manual_seed(1)).int()
    table[0, prefix:] = torch.arange(prefix, seq, dtype=torch.int32)
    one = torch.ones(1, dtype=torch.int32)
    meta = AttentionMetadata(
        phase=Phase.PREFILL, slot_table=table, rows=torch.zeros(1, dtype=torch.int64),
        prefix_lens=one * prefix, extend_lens=one * tokens, seq_lens=one * seq,
        cu_extend=torch.tensor([0, tokens], dtype=torch.int32),
        out_slots=table[0, prefix:].long(), prefix_lens_cpu=(prefix,), extend_lens_cpu=(tokens,),
        max_seq_len=seq, max_extend_len=tokens, rows_cpu=(0,))
    return meta, seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=516)
    ap.add_argument("--prefix", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--window", type=int, default=None,
                    help="native over everything vs native with this sliding window")
    ap.add_argument("--layers", type=int, default=LAYERS)
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    kernel = load_prefill_attention()
    assert kernel is not None, "the native kernel did not build (see the warning above)"
    meta, slots = extend_meta(args.tokens, args.prefix)
    g = torch.Generator().manual_seed(0)
    pool = Pool(torch.randn(args.layers, slots, HKV, D, generator=g).to(dtype),
                torch.randn(args.layers, slots, HKV, D, generator=g).to(dtype), None)
    qkv = [torch.randn(args.tokens, HQ + 2 * HKV, D, generator=g).to(dtype)
           for _ in range(args.layers)]
    native = TorchAttentionBackend(prefill=kernel)
    # name: (backend, window)
    paths: dict[str, tuple[TorchAttentionBackend, int | None]] = {
        "torch": (TorchAttentionBackend(), None), "native": (native, None)}
    labels = {"torch": "torch  (query chunks + flash)", "native": "native (prefill_attention)"}
    if args.window is not None:
        paths = {"native": (native, None), "window": (native, args.window)}
        labels = {"native": "native, causal over all", "window": f"native, window {args.window}"}
    times: dict[str, list[float]] = {name: [] for name in paths}
    outs: dict[str, torch.Tensor] = {}
    for name, (backend, window) in paths.items():  # warm-up
        outs[name] = forward(backend, qkv, pool, meta, time.perf_counter, window)[1]
    for _ in range(args.runs):
        for name, (backend, window) in paths.items():
            times[name].append(forward(backend, qkv, pool, meta, time.perf_counter, window)[0])
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    first, second = list(paths)
    print(f"{args.tokens} tokens after {args.prefix} cached, {args.dtype}, {args.layers} layers, "
          f"{args.num_threads} thread(s), median of {args.runs}:")
    for name in paths:
        print(f"  {labels[name]:30s} {med[name]:8.1f} ms/forward")
    line = f"  ratio {med[first] / med[second]:.2f}x"
    if args.window is None:  # a window changes the output: no difference to compare
        diff = (outs[first].float() - outs[second].float()).abs().max().item()
        line += f"   max |difference| {diff:.2e}"
    print(line)


if __name__ == "__main__":
    main()
