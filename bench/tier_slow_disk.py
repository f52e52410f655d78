"""The tiers on a slow disk: every file operation of the local and the shared tier delayed
(an injected delay in the store, FileOps.delay_s; 50 ms by default), against the tiers off on
the same workload: the p99 time of a decode step, and that no request fails.

    python -m bench.tier_slow_disk                       # SmolLM2-135M, fp32, 50 ms per op
    python -m bench.tier_slow_disk --model PATH --sessions 8 --turns 3 --delay-ms 50

Workload: agent sessions in rounds; each round sends every session's next turn (its whole
history plus `--turn-tokens` new tokens) at once, `--output-tokens` greedy tokens each, into a
pool (`--pool` tokens) the histories outgrow, so sessions are evicted (demoted to the tiers)
between turns and loaded back (or recomputed) on their next. The offline engine is stepped
directly; a step is a decode step when the batch the model ran was a decode batch, and its
time is the whole engine.step() (scheduling, the tiers' work on the step, the forward, the
commit). The systems alternate per run; ratios are of figures from the same run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from radixserve import LLM
from radixserve.cache.tiers import BlockStore, Tier
from radixserve.ipc.messages import GenerateMsg
from radixserve.types import Phase, SamplingParams


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 2 else xs[0]


def run_trace(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    engine, g = llm.engine, torch.Generator().manual_seed(0)
    phases: list[Phase] = []
    run = engine.runner.run

    def recorded(batch: Any) -> Any:  # remembers the phase of the batch the model ran
        phases.append(batch.phase)
        return run(batch)

    engine.runner.run = recorded  # type: ignore[method-assign]
    histories = [torch.randint(100, 40000, (args.turn_tokens,), generator=g).tolist()
                 for _ in range(args.sessions)]
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    decode_s: list[float] = []
    failed = finished = cached = 0
    for turn in range(args.turns):
        for s, history in enumerate(histories):
            engine.add_request(GenerateMsg(f"{s}-{turn}", history, params, ""))
        outputs: dict[str, list[int]] = {}
        while engine.has_work():
            before = len(phases)
            t0 = time.perf_counter()
            for o in engine.step():
                if o.token_id is not None:
                    outputs.setdefault(o.rid, []).append(o.token_id)
                if o.finish_reason is not None:
                    finished += 1
                    failed += o.finish_reason.value in ("abort", "error")
                    cached += o.num_cached_tokens
            if len(phases) > before and phases[-1] is Phase.DECODE:
                decode_s.append(time.perf_counter() - t0)
        for s in range(args.sessions):
            new = torch.randint(100, 40000, (args.turn_tokens,), generator=g).tolist()
            histories[s] = histories[s] + outputs.get(f"{s}-{turn}", []) + new
    engine.runner.run = run  # type: ignore[method-assign]
    stats = llm.kv_stats().get("kv_offload") or {}
    return {"p99": p99(decode_s), "p50": statistics.median(decode_s), "steps": len(decode_s),
            "failed": failed, "finished": finished, "cached": cached,
            "wait_s": (stats.get("step_wait") or {}).get("sum", 0.0),
            "choices": {t: v.get("choices_total") for t, v in stats.get("tiers", {}).items()}}


def make_llm(args: argparse.Namespace, root: Path | None) -> LLM:
    kw: dict[str, Any] = {}
    if root is not None:
        kw = {"kv_offload_dir": root / "local", "kv_shared_dir": root / "shared"}
    if args.model is not None:
        kw["model"] = args.model
    llm = LLM(dtype=args.dtype, kv_cache_tokens=args.pool,
              max_model_len=args.max_model_len, **kw)
    set_delay(llm, args.delay_ms / 1000)  # every file operation from now on
    return llm


def set_delay(llm: LLM, seconds: float) -> None:
    tiers = llm.engine.tiers
    for store in ([] if tiers is None else tiers.stores.values()):
        assert isinstance(store, BlockStore) and store.tier in (Tier.LOCAL, Tier.SHARED)
        store.files.delay_s = seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the engine's default model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=96)
    p.add_argument("--output-tokens", type=int, default=24)
    p.add_argument("--pool", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--delay-ms", type=float, default=50.0)
    p.add_argument("--runs", type=int, default=1)
    args = p.parse_args()
    results: dict[str, list[dict[str, Any]]] = {"off": [], "slow tiers": []}
    for _ in range(args.runs):
        for name in results:
            with tempfile.TemporaryDirectory() as tmp:
                llm = make_llm(args, None if name == "off" else Path(tmp))
                results[name].append(run_trace(llm, args))
                set_delay(llm, 0.0)  # the shutdown's write-back is not what is measured
                llm.close()
    for name, runs in results.items():
        for r in runs:
            print(f"{name:>10}: decode p99 {r['p99'] * 1e3:.2f} ms, p50 {r['p50'] * 1e3:.2f} ms "
                  f"over {r['steps']} steps; {r['finished']} finished, {r['failed']} failed; "
                  f"{r['cached']} cached tokens; tier wait on the step {r['wait_s']:.3f} s; "
                  f"choices {r['choices']}")
    ratios = [t["p99"] / o["p99"] for o, t in zip(results["off"], results["slow tiers"],
                                                  strict=True)]
    print(f"decode p99, slow tiers / off: {', '.join(f'{x:.3f}' for x in ratios)} "
          f"(delay {args.delay_ms:.0f} ms per file operation)")


if __name__ == "__main__":
    main()
