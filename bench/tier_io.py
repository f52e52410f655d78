"""Load vs recompute: per-token KV load time from the local tier against prefill time.

The per-token time to load KV from the local tier (radixserve/cache/tiers BlockStore)
against the per-token prefill time of the same model, side by side in one run.

    python -m bench.tier_io                          # SmolLM2-135M, fp32 (this CPU has no bf16)
    python -m bench.tier_io --dtype bfloat16 --tokens 4096 --dir /var/tmp

Load: blocks of `block_size` tokens, each K and V of every layer as one payload ((2, layers,
block, kv_heads, head_dim) in the model's dtype), written once through BlockStore.put (fsync +
rename), then read back with BlockStore.get and copied into a pool-shaped tensor, twice: with the
files in the page cache, and after posix_fadvise(DONTNEED) dropped them (a cold read from the
drive, as after a restart or on a big tier). Prefill: LLM.generate of a random prompt of the
same length with max_tokens=1 (a new prompt each run, so nothing is cached); the engine's own
prefill, whole prompt, including its one-token decode.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from radixserve import LLM
from radixserve.cache.tiers import BlockStore, Fingerprint, Tier, block_key
from radixserve.kv_events.publisher import block_hashes
from radixserve.types import SamplingParams


def prefill_s_per_token(llm: LLM, n: int, runs: int, g: torch.Generator) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([torch.randint(100, 40000, (n,), generator=g).tolist()], params)  # warm-up
    times = []
    for _ in range(runs):
        ids = torch.randint(100, 40000, (n,), generator=g).tolist()
        t = time.perf_counter()
        llm.generate([ids], params)
        times.append((time.perf_counter() - t) / n)
    return statistics.median(times)


def drop_page_cache(store: BlockStore, keys: list[str]) -> None:
    for k in keys:
        fd = os.open(store.path(k), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_s_per_token(store: BlockStore, keys: list[str], dst: torch.Tensor, block: int,
                     dtype: torch.dtype) -> float:
    """Get every block and copy it into dst ((2, layers, tokens, kv_heads, head_dim))."""
    t = time.perf_counter()
    for i, k in enumerate(keys):
        data = store.get(k).data
        assert data is not None, "a block written by this run was a miss"
        src = torch.frombuffer(data, dtype=dtype).view(  # (2, L, block, H, D), read-only
            2, dst.shape[1], block, dst.shape[3], dst.shape[4])
        dst[:, :, i * block : (i + 1) * block].copy_(src)
    return (time.perf_counter() - t) / (len(keys) * block)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length = tokens loaded")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=None, help="parent of the tier directory (default: $TMPDIR)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    # frombuffer on the immutable bytes get() returns: only ever read (copied into dst)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    llm = LLM(args.model, dtype=args.dtype)
    spec, dtype = llm.engine.runner.spec, llm.engine.runner.dtype
    layers, heads, dim, bs = spec.num_layers, spec.num_kv_heads, spec.head_dim, args.block_size
    prefill = prefill_s_per_token(llm, args.tokens, args.runs, g)

    fp = Fingerprint(args.model, str(dtype).removeprefix("torch."), layers, heads, dim, bs)
    n_blocks = args.tokens // bs
    kv = torch.randn(2, layers, n_blocks * bs, heads, dim).to(dtype)  # (2, L, T, H, D)
    keys = [block_key(h, fp) for h in block_hashes(list(range(n_blocks * bs)), bs)]
    root = Path(tempfile.mkdtemp(prefix="tier_io-", dir=args.dir))
    try:
        # ndarray.data: a memoryview of each block's bytes, no copy
        blocks = [kv[:, :, i * bs : (i + 1) * bs].contiguous().view(torch.uint8).numpy().data
                  for i in range(n_blocks)]
        nosync = BlockStore(root / "nosync", 1 << 40, fp, Tier.LOCAL, durable=False)
        t = time.perf_counter()
        for k, b in zip(keys, blocks, strict=True):
            nosync.put(k, b)
        store_nosync = (time.perf_counter() - t) / (n_blocks * bs)
        store = BlockStore(root / "tier", 1 << 40, fp, Tier.LOCAL)
        t = time.perf_counter()
        for k, b in zip(keys, blocks, strict=True):
            store.put(k, b)
        store_tok = (time.perf_counter() - t) / (n_blocks * bs)
        dst = torch.empty_like(kv)
        warm = statistics.median(load_s_per_token(store, keys, dst, bs, dtype)
                                 for _ in range(args.runs))
        assert torch.equal(dst, kv)
        cold = []
        for _ in range(args.runs):
            drop_page_cache(store, keys)
            cold.append(load_s_per_token(store, keys, dst, bs, dtype))
        cold_tok = statistics.median(cold)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    kv_bytes = 2 * layers * heads * dim * kv.element_size()
    print(f"model {args.model} {fp.dtype}: {kv_bytes} KV bytes/token, block {bs} tokens, "
          f"{args.tokens} tokens, median of {args.runs}; tier dir under {root.parent}")
    print(f"{'prefill (recompute)':<28}{prefill * 1e6:10.1f} us/token")
    for name, s in (("store (put, no fsync)", store_nosync), ("store (put, fsync)", store_tok),
                    ("load, page cache", warm),
                    ("load, after DONTNEED", cold_tok)):
        print(f"{name:<28}{s * 1e6:10.1f} us/token  {kv_bytes / s / 1e9:6.2f} GB/s"
              + ("" if name.startswith("store") else f"  {prefill / s:6.1f}x faster than prefill"))


if __name__ == "__main__":
    main()
