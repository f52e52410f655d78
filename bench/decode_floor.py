"""Decode steps against the memory floor (weight bytes / read bandwidth), per CPU tier and dtype.

On CPU a decode step at small batch reads every weight once, so its floor is the model's
weight bytes / the machine's read bandwidth. This measures both, side by side:
- bandwidth: a sum over a 1 GiB tensor (torch, the same thread count as the engine), the
  median of several passes: GB/s read, twice: in the 4 KB pages it was allocated in, then
  madvised and collapsed into 2 MB pages (platform/huge_pages.py); the floor uses the faster
  (the engine puts its weights in 2 MB pages where the kernel allows: model/weight_memory.py;
  RADIXSERVE_WEIGHT_HUGE_PAGES=0 leaves them in 4 KB pages, the before of that change);
- the decode step: offline `LLM.generate` (no HTTP) of B distinct 16-token prompts with
  --output-len tokens each (greedy, ignore_eos), B = 1 and 8; the median engine step after the
  prefill (schedule, forward, sample), and where it goes: the linear layers (LM head
  included), attention with the KV store, the rest of the forward (embedding, norms, RoPE),
  and the step outside the forward.
Prints per (tier, dtype, batch): step ms, floor ms (weight bytes / bandwidth) and their ratio:
the bandwidth is probed right before each run, and the ratio is the median over runs of
each run's median step over its own floor (side by side, as a shared machine's bandwidth
drifts).
Each (tier, dtype) runs in its own process with $RADIXSERVE_CPU_ISA set (the native kernels
at that tier) and oneDNN's and ATen's dispatch capped alike (ONEDNN_MAX_CPU_ISA,
ATEN_CPU_CAPABILITY), so that a capped tier stands for a CPU of that tier.

    python -m bench.decode_floor --num-threads 2
    python -m bench.decode_floor --tiers avx2,avx512_bf16 --dtypes float32,bfloat16 --runs 3
    python -m bench.decode_floor --num-threads 1 --clock cpu   # on a shared, loaded machine

`--clock cpu` times the steps, their parts and the bandwidth's sums in the main thread's CPU
time (time.thread_time), which a loaded machine's preemptions do not inflate; it needs
--num-threads 1 (with more, the other threads' work would not be counted).

Does not know: the HTTP server (bench.compare measures through it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from bench.common.part_clock import PartClock, time_parts
from radixserve import LLM
from radixserve.platform.cpu_isa import ENV_CPU_ISA, host_tiers
from radixserve.platform.huge_pages import advise_huge, huge_bytes
from radixserve.types import SamplingParams

BANDWIDTH_BYTES = 2**30


def _sum_rate(x: torch.Tensor, passes: int, now: Callable[[], float]) -> float:
    x.sum()  # pages touched
    times = []
    for _ in range(passes):
        t = now()
        x.sum()
        times.append(now() - t)
    return x.numel() * x.element_size() / statistics.median(times) / 1e9


def read_bandwidth(passes: int = 7, now: Callable[[], float] = time.perf_counter
                   ) -> tuple[float, float | None]:
    """GB/s of a sum over BANDWIDTH_BYTES of float32 (torch's threads), median of `passes`:
    in the heap's 4 KB pages, then the same memory madvised and collapsed into 2 MB pages
    (None where the kernel gives none: THP off, not Linux)."""
    x = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    small = _sum_rate(x, passes, now)  # NOTE: THP `always` gives 2 MB pages here already
    advise_huge([(x.data_ptr(), BANDWIDTH_BYTES)])
    if huge_bytes([(x.data_ptr(), BANDWIDTH_BYTES)]) < BANDWIDTH_BYTES // 2:
        return small, None
    return small, _sum_rate(x, passes, now)


class StepClock(PartClock):
    """Seconds per engine step and per part of each step's forward."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(now)
        self.steps: list[float] = []
        self.parts: list[dict[str, float]] = []


def instrument(llm: LLM, clock: StepClock) -> None:
    engine = llm.engine
    time_parts(engine.runner.model, clock)  # linear, attention, forward
    step = engine.step

    def timed_step() -> Any:
        clock.take()
        t = clock.now()
        out = step()
        clock.steps.append(clock.now() - t)
        clock.parts.append(clock.take())
        return out

    engine.step = timed_step  # type: ignore[method-assign]


def measure(llm: LLM, clock: StepClock, batch: int, output_len: int, runs: int,
            weight_bytes: int) -> dict[str, Any]:
    """Median decode step (every step after the first: the prefill) over `runs` runs, and
    the floor side by side: the read bandwidth is probed right before each run, and each
    run's ratio is its median step over its own floor (a shared machine's bandwidth drifts
    by tens of percent within minutes; one probe per process made the ratio swing with it).
    """
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    steps: list[float] = []
    parts: dict[str, list[float]] = defaultdict(list)
    probes: list[tuple[float, float | None]] = []
    ratios: list[float] = []
    for _ in range(runs):
        prompts = [torch.randint(100, 40000, (16,), generator=g).tolist() for _ in range(batch)]
        llm.engine.flush_cache()
        probes.append(read_bandwidth(now=clock.now))
        clock.steps.clear()
        clock.parts.clear()
        llm.generate(prompts, params)
        steps += clock.steps[1:]
        ratios.append(statistics.median(clock.steps[1:]) / floor_s(weight_bytes, probes[-1]))
        for p in clock.parts[1:]:
            for name in ("forward", "linear", "attention"):
                parts[name].append(p.get(name, 0.0))
    step = statistics.median(steps)
    fwd, lin, att = (statistics.median(parts[n]) for n in ("forward", "linear", "attention"))
    huge = [h for _, h in probes if h is not None]
    return {"step": step, "linear": lin, "attention": att, "other fwd": fwd - lin - att,
            "outside fwd": step - fwd, "ratio": statistics.median(ratios),
            "bandwidth": statistics.median(b for b, _ in probes),
            "bandwidth_huge": statistics.median(huge) if huge else None}


def floor_s(weight_bytes: int, probe: tuple[float, float | None]) -> float:
    """Seconds to read the weights once at the faster of a probe's two bandwidths (GB/s)."""
    return weight_bytes / (max(probe[0], probe[1] or 0.0) * 1e9)


# What each tier caps the libraries' own dispatch to (oneDNN's GEMMs, ATen's vector kernels),
# set before torch starts in the worker: a capped run then stands for a CPU of that tier.
ONEDNN_ISA = {"portable": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE",
              "avx512_bf16": "AVX512_CORE_BF16", "amx": "AVX512_CORE_AMX"}
ATEN_ISA = {"portable": "default", "avx2": "avx2"}  # AVX-512 tiers: ATen's default choice


def worker(args: argparse.Namespace) -> None:
    """One (tier, dtype): every batch size, one JSON line per batch on stdout."""
    kw: dict[str, Any] = {"dtype": args.dtype}
    if args.num_threads is not None:
        kw["num_threads"] = args.num_threads
    llm = LLM(model=args.model, **kw)
    layers, head = llm.engine.runner.model.linear_weight_bytes()
    now = time.thread_time if args.clock == "cpu" else time.perf_counter
    clock = StepClock(now)
    instrument(llm, clock)
    llm.generate([[100, 200, 300]], SamplingParams(temperature=0, max_tokens=4))
    pages = llm.engine.runner.weight_pages
    for batch in (int(b) for b in args.batches.split(",")):
        m = measure(llm, clock, batch, args.output_len, args.runs, layers + head)
        print(json.dumps({"tier": args.tier, "dtype": args.dtype, "batch": batch, **m,
                          "weight_pages": None if pages is None else pages.describe(),
                          "weight_bytes": layers + head,
                          "kernels": getattr(llm.engine.runner, "cpu_kernels", None),
                          "threads": torch.get_num_threads()}), flush=True)
    llm.close()


def run_worker(args: argparse.Namespace, tier: str, dtype: str) -> list[dict[str, Any]]:
    env = {**os.environ, ENV_CPU_ISA: tier, "ONEDNN_MAX_CPU_ISA": ONEDNN_ISA[tier]}
    if tier in ATEN_ISA:
        env["ATEN_CPU_CAPABILITY"] = ATEN_ISA[tier]
    cmd = [sys.executable, "-m", "bench.decode_floor", "--worker", "--tiers", tier,
           "--dtypes", dtype, "--batches", args.batches, "--model", args.model,
           "--output-len", str(args.output_len), "--runs", str(args.runs), "--clock", args.clock]
    if args.num_threads is not None:
        cmd += ["--num-threads", str(args.num_threads)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tiers", default=None,
                    help="comma-separated; default: avx2 (where the CPU has it) and the best")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--num-threads", type=int, default=None, help="default: the engine's")
    ap.add_argument("--output-len", type=int, default=129)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the main thread's CPU time (needs --num-threads 1)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.clock == "cpu" and args.num_threads != 1:
        ap.error("--clock cpu needs --num-threads 1: other threads' work is not counted")
    if args.worker:
        args.tier, args.dtype = args.tiers, args.dtypes
        worker(args)
        return
    host = [t.value for t in host_tiers()]
    tiers = (args.tiers.split(",") if args.tiers
             else list(dict.fromkeys(t for t in ("avx2", host[-1]) if t in host)))
    rows = [row for tier in tiers for dtype in args.dtypes.split(",")
            for row in run_worker(args, tier, dtype)]
    for r in rows:
        if r["batch"] == rows[0]["batch"]:
            print(f"{r['tier']} {r['dtype']}: CPU kernels {r['kernels']}; torch threads "
                  f"{r['threads']}")
    print(f"clock: {args.clock}")
    for r in rows:
        if r["batch"] == rows[0]["batch"]:
            print(f"{r['tier']} {r['dtype']}: weights: {r['weight_pages'] or '4 KB pages'}")
    print("floor: weight bytes / the faster of the two bandwidths (a sum over 1 GiB in 4 KB "
          "and in 2 MB pages), probed before each run; ratio: the median over runs of each "
          "run's step / its own floor")
    print(f"\n{'tier':12s} {'dtype':9s} {'B':>2s} {'step ms':>8s} {'floor ms':>8s} "
          f"{'ratio':>6s} {'GB/s 4K':>7s} {'GB/s 2M':>7s} {'weights MB':>10s} | "
          f"{'linear':>6s} {'attn':>6s} {'other':>6s} {'outside':>7s}  (ms)")
    for r in rows:
        floor = floor_s(r["weight_bytes"], (r["bandwidth"], r["bandwidth_huge"]))
        huge = "-" if r["bandwidth_huge"] is None else f"{r['bandwidth_huge']:.1f}"
        print(f"{r['tier']:12s} {r['dtype']:9s} {r['batch']:2d} {r['step'] * 1e3:8.1f} "
              f"{floor * 1e3:8.1f} {r['ratio']:5.2f}x {r['bandwidth']:7.1f} {huge:>7s} "
              f"{r['weight_bytes'] / 1e6:10.0f} | {r['linear'] * 1e3:6.1f} "
              f"{r['attention'] * 1e3:6.1f} {r['other fwd'] * 1e3:6.1f} "
              f"{r['outside fwd'] * 1e3:7.1f}")


if __name__ == "__main__":
    main()
