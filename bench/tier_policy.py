"""The local tier's write policy, offline: write-back against write-through.

Write-back (demote on eviction) against
write-through (write every block when it enters the tree), with the tier off as the baseline,
side by side on one agent-session trace whose contexts outgrow the pool.

    python -m bench.tier_policy                       # SmolLM2, 3 runs, interleaved
    python -m bench.tier_policy --sessions 8 --turns 4 --pool 2048 --runs 1

Each round sends every session's next turn as one batch (LLM.generate); a session's prompt is
its whole history, so by the next round the pool has evicted it. Reported per system: wall
time of the trace, TTFT p50/p90 (the engine's RequestOutput.ttft), the prefix hit rate (cached
prompt tokens / prompt tokens), bytes written to the tier and the writer's seconds; then the
ratios against write-back. The default policy in config.py is the faster one here.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from radixserve import LLM
from radixserve.types import SamplingParams

SYSTEMS = ("off", "write_back", "write_through")


@dataclass
class RunResult:
    seconds: float
    ttfts: list[float]
    prompt_tokens: int
    cached_tokens: int
    stored_bytes: int
    store_seconds: float


def trace(args: argparse.Namespace, seed: int) -> list[list[list[int]]]:
    """rounds[t][s]: session s's prompt at turn t (system + its growing history)."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(100, 40000, (args.system_len,), generator=g).tolist()
    histories: list[list[int]] = [[] for _ in range(args.sessions)]
    rounds = []
    for _ in range(args.turns):
        for h in histories:
            h += torch.randint(100, 40000, (args.turn_len,), generator=g).tolist()
        rounds.append([system + list(h) for h in histories])
    return rounds


def run_system(name: str, args: argparse.Namespace, rounds: list[list[list[int]]]) -> RunResult:
    kw: dict[str, Any] = {"kv_cache_tokens": args.pool, "max_model_len": args.pool}
    tmp = None
    if name != "off":
        tmp = tempfile.TemporaryDirectory(prefix="tier-policy-")
        kw.update(kv_offload_dir=tmp.name, kv_offload_write_policy=name)
    llm = LLM(model=args.model, dtype=args.dtype, **kw)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    ttfts: list[float] = []
    prompt = cached = 0
    t0 = time.perf_counter()
    for batch in rounds:
        for out in llm.generate(batch, params):
            ttfts.append(out.ttft)
            prompt += out.num_prompt_tokens
            cached += out.num_cached_tokens
    seconds = time.perf_counter() - t0
    stored = store_s = 0.0
    tiers = llm.engine.tiers
    if tiers is not None:
        tiers.writer.flush()
        local = llm.kv_stats()["kv_offload"]["tiers"]["local"]
        stored, store_s = local["stored_bytes_total"], local["store_seconds_total"]
    llm.close()
    del llm
    gc.collect()
    if tmp is not None:
        tmp.cleanup()
    return RunResult(seconds, ttfts, prompt, cached, int(stored), store_s)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--turn-len", type=int, default=192)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--pool", type=int, default=2048, help="--kv-cache-tokens")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    args = p.parse_args()
    systems = args.systems.split(",")
    results: dict[str, list[RunResult]] = {s: [] for s in systems}
    for run in range(args.runs):  # interleaved: machine drift hits every system alike
        rounds = trace(args, seed=run)
        for name in systems:
            results[name].append(run_system(name, args, rounds))
    total = sum(len(b) for b in trace(args, 0))
    print(f"# {args.sessions} sessions x {args.turns} turns, {total} requests, pool "
          f"{args.pool} tokens, final context {args.system_len + args.turns * args.turn_len}; "
          f"median of {args.runs} runs")
    print("| system | trace s | TTFT p50 ms | TTFT p90 ms | hit rate | tier MB written "
          "| writer s |")
    print("|---|---|---|---|---|---|---|")
    med: dict[str, float] = {}
    for name, runs in results.items():
        secs = statistics.median(r.seconds for r in runs)
        med[name] = secs
        ttfts = [t for r in runs for t in r.ttfts]
        hit = sum(r.cached_tokens for r in runs) / max(1, sum(r.prompt_tokens for r in runs))
        mb = statistics.median(r.stored_bytes for r in runs) / 1e6
        ws = statistics.median(r.store_seconds for r in runs)
        print(f"| {name} | {secs:.2f} | {1000 * pct(ttfts, 50):.0f} | "
              f"{1000 * pct(ttfts, 90):.0f} | {100 * hit:.1f}% | {mb:.1f} | {ws:.2f} |")
    if "write_back" in med:
        for name, secs in med.items():
            print(f"{name}: {secs / med['write_back']:.2f}x the write-back trace time")


if __name__ == "__main__":
    main()
