"""The load-or-recompute choice under a slow phase: the local tier's loads made `--slowdown`
times slower (an injected per-operation delay in the store) for `--slow-s` seconds, then
normal again: what the engine chose in each phase, and how long after the slow phase ended
loading resumed (the choice probes a skipped tier every 5 s: it never latches off).

    python -m bench.tier_choice                          # SmolLM2-135M, fp32, 100x for 30 s
    python -m bench.tier_choice --slowdown 100 --slow-s 30 --fast-s 60 --tokens 300
    python -m bench.tier_choice --kv-heavy               # a random model, KV-heavy (below)

One request at a time, cycling over `--prompts` prompts that were computed cold (the engine's
prefill timings fit its cost model) and then flushed to the local tier; after each request the
pool is flushed again, so every request's prefix is in the tier. The delay per file operation
is (slowdown - 1) x the measured time of one block's load before the slow phase.

Whether a slowdown makes recomputing win depends on the model: on a CPU SmolLM2-135M's
prefill of a token costs ~200x its 46 KB load from the page cache, so at 100x loading still
wins (nothing to resume from). `--kv-heavy` runs a random Llama whose KV is large next to its
compute (8 layers of 8 KV heads of 32, hidden 256: 16 KB of fp32 KV and ~10 MFLOP a token),
where a normal load is cheaper than recomputing and a 100x slower one is not, as a real model
on a GPU (cheap prefill) or a real remote disk would be.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from radixserve import LLM
from radixserve.cache.tiers import BlockStore, Tier
from radixserve.model_source import resolve_model
from radixserve.tokenizer import load_tokenizer
from radixserve.types import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def one(llm: LLM, prompt: list[int]) -> tuple[str, float]:
    """Run `prompt` (its prefix in the tier); the choice the engine made, and the seconds."""
    tiers = llm.engine.tiers
    assert tiers is not None
    before = dict(tiers.choice.counts[Tier.LOCAL])
    t0 = time.perf_counter()
    llm.generate([prompt], PARAMS)
    seconds = time.perf_counter() - t0
    assert llm.engine.flush_cache()
    after = tiers.choice.counts[Tier.LOCAL]
    return next((c for c in ("probe", "load", "recompute") if after[c] > before[c]), "-"), seconds


def phase(llm: LLM, prompts: list[list[int]], seconds: float, stop_at_load: bool
          ) -> list[tuple[float, str, float]]:
    start, out, i = time.monotonic(), [], 0
    while time.monotonic() - start < seconds:
        choice, took = one(llm, prompts[i % len(prompts)])
        out.append((time.monotonic() - start, choice, took))
        i += 1
        if stop_at_load and choice == "load":
            break
    return out


def kv_heavy_model(path: Path) -> str:
    from tests.tiny_models import make_tiny_model

    return str(make_tiny_model(path, hidden_size=256, num_layers=8, num_heads=8,
                               num_kv_heads=8, max_position_embeddings=2048))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slowdown", type=float, default=100.0)
    p.add_argument("--slow-s", type=float, default=30.0)
    p.add_argument("--fast-s", type=float, default=60.0)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv-heavy", action="store_true",
                   help="a random KV-heavy Llama instead of --model (see the docstring)")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = kv_heavy_model(Path(tmp) / "kv_heavy") if args.kv_heavy else args.model
        vocab = len(load_tokenizer(resolve_model(model).hf_dir))
        lo, hi = min(100, vocab // 4), min(40000, vocab)

        def ids(n: int) -> list[int]:
            return torch.randint(lo, hi, (n,), generator=g).tolist()

        prompts = [ids(args.tokens) for _ in range(args.prompts)]
        llm = LLM(model=model, dtype=args.dtype, kv_offload_dir=Path(tmp) / "tier",
                  kv_cache_tokens=4096, max_model_len=max(1024, 2 * args.tokens))
        for n in (32, 64, 128, 200, 256, 384, 96, 160):  # cold prefills of varied shapes
            llm.generate([ids(n)], PARAMS)
        llm.generate(prompts, PARAMS)
        assert llm.engine.flush_cache() and llm.engine.tiers is not None
        assert llm.engine.tiers.writer.flush()
        normal = phase(llm, prompts, 0.0, False) + phase(llm, prompts, 3.0, False)
        stats: dict[str, Any] = llm.kv_stats()["kv_offload"]
        blocks = stats["tiers"]["local"]["loaded_bytes_total"] / llm.engine.tiers.codec.block_bytes
        per_block = stats["tiers"]["local"]["load_seconds_total"] / max(blocks, 1)
        store = llm.engine.tiers.stores[Tier.LOCAL]
        assert isinstance(store, BlockStore)
        store.files.delay_s = (args.slowdown - 1) * per_block
        slow = phase(llm, prompts, args.slow_s, False)
        store.files.delay_s = 0.0
        fast = phase(llm, prompts, args.fast_s, True)
        llm.close()
    for name, rows in (("normal", normal), ("slow", slow), ("normal again", fast)):
        counts = {c: sum(r[1] == c for r in rows) for c in ("load", "probe", "recompute")}
        mean = sum(r[2] for r in rows) / max(len(rows), 1)
        print(f"{name:>12}: {len(rows)} requests, choices {counts}, mean request {mean:.3f} s")
    print(f"model: {'kv-heavy random Llama' if args.kv_heavy else args.model}, "
          f"{args.tokens}-token prompts; prefill ~{stats['prefill_tokens_per_s'] or 0:.0f} "
          f"tokens/s (fitted, at a 1k context)")
    print(f"one block's load before the slow phase: {per_block * 1e3:.2f} ms; delay per file "
          f"operation in it: {(args.slowdown - 1) * per_block * 1e3:.1f} ms")
    resumed = next((t for t, c, _ in fast if c == "load"), None)
    print("loads resumed", "never" if resumed is None else f"{resumed:.1f} s after the slow "
          "phase ended", f"(choices in order: {' '.join(c for _, c, _ in fast)})")


if __name__ == "__main__":
    main()
