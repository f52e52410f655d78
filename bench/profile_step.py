"""Step-level profile of the engine on the reference shared-prefix workload.

Workload (the brief's reference): 32 requests = one 500-token system prompt + a 16-token
question each, 32 output tokens each (greedy, ignore_eos), all submitted at once. Every
model forward is timed (phase, batch size, tokens); the report gives the prefill steps, the
median decode step and output tokens/s for: cache on (cold: flushed before the run, sharing
happens inside the batch), cache on (warm: the system prompt already in the tree), cache off.

    python -m bench.profile_step                       # this tree, 1 thread
    python -m bench.profile_step --threads 1,2         # both thread counts, alternating
    python -m bench.profile_step --baseline /tmp/base  # another source tree, alternating
    python -m bench.profile_step --ops                 # torch ops in one decode step

With --baseline or several thread counts, each configuration runs in its own subprocess
(`--worker`), alternating round by round, so both see the same machine load; the table is
the median over rounds. Does not know: the HTTP server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCENARIOS = ("cold", "warm", "off")  # cache on (flushed), cache on (prefix cached), cache off
HERE = Path(__file__).resolve().parent.parent


def make_prompts(num_reqs: int, system_len: int, question_len: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1)
    system = torch.randint(100, 40000, (system_len,), generator=g).tolist()
    return [system + torch.randint(100, 40000, (question_len,), generator=g).tolist()
            for _ in range(num_reqs)]


class StepTimer:
    """Wraps runner.run to record (phase, batch size, tokens, seconds) of every forward."""

    def __init__(self, runner: Any) -> None:
        self.records: list[tuple[str, int, int, float]] = []
        self._run: Callable[[Any], Any] = runner.run
        runner.run = self._timed

    def _timed(self, batch: Any) -> Any:
        t = time.perf_counter()
        out = self._run(batch)
        self.records.append((batch.phase.value, batch.size, batch.num_tokens,
                             time.perf_counter() - t))
        return out


def run_scenario(llm: Any, timer: StepTimer, prompts: list[list[int]], params: Any,
                 scenario: str) -> dict[str, Any]:
    llm.engine.flush_cache()
    if scenario == "warm":
        llm.generate([prompts[0]], params)  # puts the system prompt (and one question) in the tree
    timer.records.clear()
    t = time.perf_counter()
    res = llm.generate(prompts, params)
    total = time.perf_counter() - t
    steps = list(timer.records)
    decode = [s for p, _, _, s in steps if p == "decode"]
    return {
        "tok_s": sum(len(r.token_ids) for r in res) / total,
        "total_s": total,
        "decode_ms": 1000 * statistics.median(decode) if decode else 0.0,
        "prefill_ms": [round(1000 * s, 1) for p, _, _, s in steps if p == "prefill"],
        "prefill_shapes": [(b, n) for p, b, n, _ in steps if p == "prefill"],
        "ttft_s": statistics.mean(r.ttft for r in res),
        "outputs": [r.token_ids for r in res],
    }


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One process: load both engines, run every scenario `rounds` times, median per field."""
    import radixserve
    from radixserve import LLM
    from radixserve.types import SamplingParams

    prompts = make_prompts(args.num_reqs, args.system_len, args.question_len)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    kw: dict[str, Any] = {"model": args.model, "dtype": args.dtype}
    if args.num_threads:
        kw["num_threads"] = args.num_threads
    engines = {"on": LLM(**kw), "off": LLM(disable_radix_cache=True, **kw)}
    timers = {k: StepTimer(v.engine.runner) for k, v in engines.items()}
    for llm in engines.values():
        llm.generate([prompts[0][:64]], params)  # warm-up
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SCENARIOS}
    for _ in range(args.rounds):
        for s in SCENARIOS:
            key = "off" if s == "off" else "on"
            runs[s].append(run_scenario(engines[key], timers[key], prompts, params, s))
    import torch

    result: dict[str, Any] = {"source": str(Path(radixserve.__file__).parent.parent),
                              "threads": torch.get_num_threads()}
    for s, rs in runs.items():
        result[s] = {
            "tok_s": statistics.median(r["tok_s"] for r in rs),
            "decode_ms": statistics.median(r["decode_ms"] for r in rs),
            "ttft_s": statistics.median(r["ttft_s"] for r in rs),
            # per prefill step (same shapes every round), median over rounds
            "prefill_ms": [statistics.median(x) for x in zip(*(r["prefill_ms"] for r in rs),
                                                              strict=True)],
            "prefill_shapes": rs[0]["prefill_shapes"],
            "outputs": rs[0]["outputs"],
        }
    return result


def count_ops(args: argparse.Namespace) -> None:
    """Torch ops and their self CPU time in one step (--ops-phase, --ops-index)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from radixserve import LLM
    from radixserve.types import SamplingParams

    prompts = make_prompts(args.num_reqs, args.system_len, args.question_len)
    kw: dict[str, Any] = {"model": args.model, "dtype": args.dtype}
    if args.num_threads:
        kw["num_threads"] = args.num_threads
    llm = LLM(**kw)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    timer = StepTimer(llm.engine.runner)
    runner = llm.engine.runner
    inner = timer._run
    state = {"n": 0}

    def profiled(batch: Any) -> Any:
        if batch.phase.value != args.ops_phase:
            return inner(batch)
        state["n"] += 1
        if state["n"] != args.ops_index:
            return inner(batch)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = inner(batch)
        events = prof.key_averages()
        num_ops = sum(e.count for e in events if e.key.startswith("aten::"))
        print(f"{args.ops_phase} step (batch {batch.size}, {batch.num_tokens} tokens): "
              f"{num_ops} aten op calls "
              f"(incl. nested), {torch.get_num_threads()} threads")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.ops_rows))
        return out

    timer._run = profiled
    llm.generate(prompts, params)
    del runner


def spawn(args: argparse.Namespace, source: Path, threads: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(source))
    # -P: bench/ off sys.path, else bench/kernels.py shadows the `kernels` package that
    # transformers imports.
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "--worker", "--threads", str(threads),
           "--rounds", "1", "--model", args.model, "--dtype", args.dtype,
           "--num-reqs", str(args.num_reqs), "--system-len", str(args.system_len),
           "--question-len", str(args.question_len), "--output-len", str(args.output_len)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=source)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def fmt_row(label: str, r: dict[str, Any]) -> list[str]:
    cells = [label]
    for s in SCENARIOS:
        x = r[s]
        prefill = "+".join(f"{p:.0f}" for p in x["prefill_ms"])
        cells += [f"{x['tok_s']:.1f}", f"{x['decode_ms']:.1f}", prefill]
    return cells


def table(rows: list[list[str]]) -> str:
    header = ["config"] + [f"{s} {c}" for s in SCENARIOS
                           for c in ("tok/s", "decode ms", "prefill ms")]
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]

    def line(r: list[str]) -> str:
        return "  ".join(x.rjust(w) for x, w in zip(r, widths, strict=True))

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def median_result(rs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in SCENARIOS:
        out[s] = {k: statistics.median(r[s][k] for r in rs) for k in ("tok_s", "decode_ms")}
        out[s]["prefill_ms"] = [statistics.median(x) for x in
                                zip(*(r[s]["prefill_ms"] for r in rs), strict=True)]
    return out


def compare(args: argparse.Namespace) -> None:
    configs: list[tuple[str, Path, int]] = []
    sources = [("this", HERE)] + ([("baseline", Path(args.baseline))] if args.baseline else [])
    for name, src in sources:
        for t in args.thread_list:
            configs.append((f"{name} t={t}", src, t))
    results: dict[str, list[dict[str, Any]]] = {c[0]: [] for c in configs}
    for i in range(args.rounds):
        order = configs if i % 2 == 0 else configs[::-1]
        for label, src, t in order:
            results[label].append(spawn(args, src, t))
    print(f"reference workload: {args.num_reqs} reqs, {args.system_len}-token shared prefix + "
          f"{args.question_len}-token question, {args.output_len} output tokens; "
          f"median of {args.rounds} alternating rounds")
    print(table([fmt_row(label, median_result(rs)) for label, rs in results.items()]))
    first = next(iter(results.values()))[0]
    for s in SCENARIOS:
        print(f"{s}: prefill steps (batch, tokens) = {first[s]['prefill_shapes']}")
    ref = first["cold"]["outputs"]
    for label, rs in results.items():
        same = [sum(o == r for o, r in zip(run[s]["outputs"], ref, strict=True)) / len(ref)
                for run in rs for s in SCENARIOS]
        print(f"{label}: requests whose greedy output equals '{next(iter(results))}' cold's: "
              f"{min(same):.0%} (worst run/scenario; bf16 rounding differs between batchings)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", default="1",
                    help="comma-separated torch thread counts (0: the engine default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-reqs", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=500)
    ap.add_argument("--question-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--baseline", help="another source tree (containing radixserve/)")
    ap.add_argument("--ops", action="store_true", help="profile the ops of one decode step")
    ap.add_argument("--ops-rows", type=int, default=25)
    ap.add_argument("--ops-phase", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--ops-index", type=int, default=4, help="which step of that phase (1-based)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.thread_list = [int(t) for t in args.threads.split(",")]
    args.num_threads = args.thread_list[0]
    if args.worker:
        print(json.dumps(worker(args)))
    elif args.ops:
        count_ops(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
