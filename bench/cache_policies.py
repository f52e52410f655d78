"""Cache and traffic control, measured through the engine, offline and side by side.

In one run:

  scan      hot-prefix hit rate and throughput, --eviction-policy lru vs slru, on a trace of a
            few hot system prompts (each asked by two users a round) interleaved with one-off
            long prompts that together exceed the KV pool;
  priority  TTFT p50/p99 of important requests submitted among a flood of unimportant ones,
            priority on vs off (off: every request has priority 0).

    python -m bench.cache_policies                       # both, default model, 3 runs
    python -m bench.cache_policies --section scan --runs 1 --model PATH

Runs alternate between the two settings (ABAB...), each figure is the median of --runs.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from radixserve import LLM, RequestOutput, SamplingParams


def rand_ids(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def scan_trace(llm: LLM, args: argparse.Namespace, seed: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    hot = [rand_ids(args.hot_len, g) for _ in range(args.num_hot)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    hit = asked = out_tokens = 0
    start = time.perf_counter()
    for rnd in range(args.rounds):
        prompts = [h + rand_ids(args.question_len, g) for h in hot for _ in range(2)]
        outs = llm.generate(prompts, params)
        if rnd > 0:  # from the second round on, every hot prefix was seen before
            hit += sum(min(o.num_cached_tokens, args.hot_len) for o in outs)
            asked += args.hot_len * len(outs)
        # One-offs one after another (a stream), so the pool always has room for the hot set
        # plus the one in flight: what evicts the hot prefixes is the policy, not the size.
        scan = [llm.generate([rand_ids(args.scan_len, g)], params)[0]
                for _ in range(args.scan_prompts)]
        out_tokens += sum(len(o.token_ids) for o in outs + scan)
    dt = time.perf_counter() - start
    return {"hot_hit_rate": hit / asked, "out_tok_s": out_tokens / dt, "seconds": dt}


def priority_flood(llm: LLM, args: argparse.Namespace, seed: int, on: bool) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    n = args.num_low + args.num_high
    every = n // args.num_high
    important = {i for i in range(n) if i % every == every - 1}  # spread through the queue
    prompts = [rand_ids(args.prompt_len, g) for _ in range(n)]
    priority = [0 if (i in important or not on) else 1 for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    outs: list[RequestOutput] = llm.generate(prompts, params, priority=priority)
    high = sorted(outs[i].ttft for i in important)
    low = sorted(o.ttft for i, o in enumerate(outs) if i not in important)
    return {"high_ttft_p50_s": pct(high, 50), "high_ttft_p99_s": pct(high, 99),
            "low_ttft_p50_s": pct(low, 50)}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def alternate(settings: list[str], runs: int, one: Callable[[str, int], dict[str, float]]
              ) -> dict[str, dict[str, float]]:
    results: dict[str, list[dict[str, float]]] = {s: [] for s in settings}
    for r in range(runs):
        for s in settings:
            results[s].append(one(s, r))
            gc.collect()
    return {s: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
            for s, rs in results.items()}


def table(title: str, res: dict[str, dict[str, float]]) -> None:
    keys = list(next(iter(res.values())))
    print(f"\n{title}\n| setting | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for s, figs in res.items():
        print(f"| {s} | " + " | ".join(f"{figs[k]:.3f}" for k in keys) + " |")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--section", choices=["scan", "priority", "all"], default="all")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--output-len", type=int, default=4)
    g = p.add_argument_group("scan")
    g.add_argument("--kv-cache-tokens", type=int, default=2304)
    g.add_argument("--num-hot", type=int, default=3)
    g.add_argument("--hot-len", type=int, default=300)
    g.add_argument("--question-len", type=int, default=16)
    g.add_argument("--scan-prompts", type=int, default=2)
    g.add_argument("--scan-len", type=int, default=1024)
    g.add_argument("--rounds", type=int, default=6)
    g = p.add_argument_group("priority")
    g.add_argument("--num-low", type=int, default=64)
    g.add_argument("--num-high", type=int, default=8)
    g.add_argument("--prompt-len", type=int, default=256)
    g.add_argument("--max-prefill-tokens", type=int, default=1024)
    args = p.parse_args(argv)
    common: dict[str, Any] = {"dtype": args.dtype, "num_threads": args.num_threads}
    out: dict[str, Any] = {}
    if args.section in ("scan", "all"):
        llms = {pol: LLM(model=args.model, kv_cache_tokens=args.kv_cache_tokens,
                         max_model_len=args.scan_len + 64, eviction_policy=pol, **common)
                for pol in ("lru", "slru")}

        def scan_once(pol: str, r: int) -> dict[str, float]:
            llms[pol].engine.flush_cache()
            return scan_trace(llms[pol], args, seed=r)

        out["scan"] = alternate(["lru", "slru"], args.runs, scan_once)
        table("scan trace: hot-prefix hit rate and output tok/s", out["scan"])
        del llms
    if args.section in ("priority", "all"):
        llm = LLM(model=args.model, max_prefill_tokens=args.max_prefill_tokens,
                  disable_radix_cache=True, **common)  # no cache: only the ordering differs
        out["priority"] = alternate(
            ["priority off", "priority on"], args.runs,
            lambda s, r: priority_flood(llm, args, seed=r, on=s == "priority on"))
        table(f"{args.num_high} important among {args.num_low} unimportant requests: TTFT",
              out["priority"])
    return out


if __name__ == "__main__":
    main()
