"""Tiered prefix cache, end to end: tier off, on, and an infinite pool, side by side.

The same trace served with the tier off, on, and by an
infinite pool; TTFT, output throughput and hit rate side by side (issue 21's must-show).

    python -m bench.tiers                                   # agent sessions, issue scale
    python -m bench.tiers --workloads agent,rag --runs 3    # median of 3, interleaved
    python -m bench.tiers --systems off,infinite            # before the tier flags exist

Systems (each a fresh `radixserve serve`, a fresh tier directory, started per run, in turn):
  off       --kv-cache-tokens K
  on        --kv-cache-tokens K --kv-offload-dir DIR --kv-offload-size G
  shared    --kv-cache-tokens K --kv-shared-dir DIR (the shared tier alone)
  infinite  --kv-cache-tokens large enough for every token of the trace (nothing evicted)
Workloads: bench/common/tier_workloads.py. Hit rate = sum(cached_tokens) / sum(prompt tokens) from
each response's usage. Ratios: on / off (TTFT: off / on) and hit rate on / infinite.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import aiohttp

from bench.common.client import BenchError, ClientConfig, fetch_model, run_all
from bench.common.metrics import BenchSummary, RequestResult, summarize
from bench.common.server_process import ServerProcess, SystemSpec
from bench.common.tier_workloads import (
    AgentSpec,
    Session,
    build_agent_sessions,
    rag_corpus_spec,
    run_agent_sessions,
)
from bench.common.workloads import RagSpec, Workload, build_workload

SYSTEMS = ("off", "on", "infinite")
Runner = Callable[[aiohttp.ClientSession, ClientConfig, str], Awaitable[list[RequestResult]]]


@dataclass(frozen=True)
class Trace:
    name: str
    pool_tokens: int  # distinct tokens the infinite pool must hold
    run: Runner


def agent_spec(args: argparse.Namespace) -> AgentSpec:
    return AgentSpec(args.sessions, args.turns, args.system_prompt_len, args.user_len,
                     args.tool_call_len, args.tool_result_len, args.output_len, args.think_time,
                     args.stagger)


def rag_spec(args: argparse.Namespace) -> RagSpec:
    return rag_corpus_spec(args.rag_requests, args.rag_docs, args.rag_doc_len,
                           args.system_prompt_len, 32, args.output_len, args.rag_zipf)


async def _agent(http: aiohttp.ClientSession, cfg: ClientConfig, model: str, *,
                 sessions: list[Session], spec: AgentSpec) -> list[RequestResult]:
    return await run_agent_sessions(http, cfg, model, sessions, spec)


async def _rag(http: aiohttp.ClientSession, cfg: ClientConfig, model: str, *,
               workload: Workload) -> list[RequestResult]:
    return await run_all(http, cfg, model, workload)


def build_traces(args: argparse.Namespace, seed: int) -> list[Trace]:
    from radixserve.model_source import resolve_model
    from radixserve.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(args.model).hf_dir)
    traces = []
    for name in args.workloads.split(","):
        if name == "agent":
            spec = agent_spec(args)
            sessions = build_agent_sessions(spec, tok, seed)
            traces.append(Trace("agent", spec.live_tokens, partial(
                _agent, sessions=sessions, spec=spec)))
        elif name == "rag":
            rspec = rag_spec(args)
            w = build_workload(rspec, tok, seed)
            need = rspec.system_prompt_len + rspec.num_docs * (rspec.doc_len + 64)
            traces.append(Trace("rag", need, partial(_rag, workload=w)))
        else:
            raise BenchError(f"unknown workload {name!r} (agent, rag)")
    return traces


def system_argv(name: str, args: argparse.Namespace, trace: Trace, tier_dir: Path
                ) -> tuple[str, ...]:
    base = (sys.executable, "-m", "radixserve", "serve", "--model", args.model, "--host",
            "127.0.0.1", "--port", "{port}", *shlex.split(args.radixserve_args))
    k = ("--kv-cache-tokens", str(args.kv_cache_tokens))
    if name == "off":
        return (*base, *k)
    if name == "on":
        return (*base, *k, "--kv-offload-dir", str(tier_dir), "--kv-offload-size",
                str(args.offload_size))
    if name == "shared":
        return (*base, *k, "--kv-shared-dir", str(tier_dir))
    if name == "infinite":  # every token of the trace, plus room for the running batch
        return (*base, "--kv-cache-tokens", str(2 * trace.pool_tokens + 16384))
    raise BenchError(f"unknown system {name!r} ({', '.join(SYSTEMS)}, shared)")


async def _serve_trace(base_url: str, trace: Trace, args: argparse.Namespace
                       ) -> BenchSummary:
    cfg = ClientConfig(base_url, max_concurrency=args.max_concurrency, timeout_s=args.timeout,
                       disable_tqdm=True)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        model = await fetch_model(http, cfg)
        start = time.perf_counter()
        results = await trace.run(http, cfg, model)
        return summarize(results, time.perf_counter() - start)


def run_one(name: str, trace: Trace, args: argparse.Namespace, log: Path) -> BenchSummary | str:
    tier_dir = Path(tempfile.mkdtemp(prefix=f"tiers-{name}-", dir=args.tier_parent))
    try:
        spec = SystemSpec(name, system_argv(name, args, trace, tier_dir),
                          env={"PYTHONPATH": args.server_root} if args.server_root else {},
                          cwd=args.server_root or SystemSpec.cwd)
        print(f"== {trace.name} / {name}: {' '.join(spec.argv)}", flush=True)
        with ServerProcess(spec, log) as server:
            return asyncio.run(_serve_trace(server.base_url, trace, args))
    except BenchError as e:
        return str(e)
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)


FIGURES: tuple[tuple[str, Callable[[BenchSummary], float | None]], ...] = (("TTFT p50 s", lambda s: s.ttft.p50), ("TTFT p90 s", lambda s: s.ttft.p90),
           ("output tok/s", lambda s: s.output_throughput), ("hit rate", lambda s: s.hit_rate),
           ("failed", lambda s: s.failed), ("duration s", lambda s: s.duration_s))


def median_of(runs: list[BenchSummary]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for label, get in FIGURES:
        vals = [v for r in runs if (v := get(r)) is not None]
        out[label] = statistics.median(vals) if vals else None
    return out


def report(trace: str, table: dict[str, dict[str, float | None] | str], nruns: int) -> str:
    lines = [f"### {trace} (median of {nruns})", "",
             "| system | " + " | ".join(label for label, _ in FIGURES) + " |",
             "|---" * (len(FIGURES) + 1) + "|"]
    for name, row in table.items():
        cells = [row] + [""] * (len(FIGURES) - 1) if isinstance(row, str) else [
            "n/a" if row[label] is None else f"{row[label]:.3g}" for label, _ in FIGURES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    off, on, inf = (table.get(n) for n in ("off", "on", "infinite"))
    if isinstance(off, dict) and isinstance(on, dict):
        lines.append("")
        lines.append(f"TTFT p90 off/on: {_ratio(off['TTFT p90 s'], on['TTFT p90 s'])}; "
                     f"output tok/s on/off: {_ratio(on['output tok/s'], off['output tok/s'])}")
    if isinstance(on, dict) and isinstance(inf, dict):
        lines.append(f"hit rate on/infinite: {_ratio(on['hit rate'], inf['hit rate'])}")
    if isinstance(off, dict) and isinstance(inf, dict):
        lines.append(f"(infinite vs off: TTFT p90 {_ratio(off['TTFT p90 s'], inf['TTFT p90 s'])}"
                     f" lower, output tok/s {_ratio(inf['output tok/s'], off['output tok/s'])})")
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workloads", default="agent", help="comma list: agent, rag")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="off, on, shared, infinite")
    p.add_argument("--runs", type=int, default=1, help="repetitions (new seed each), median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--offload-size", type=float, default=16.0, help="GiB (--kv-offload-size)")
    p.add_argument("--tier-parent", default=None, help="where tier dirs go (default $TMPDIR)")
    p.add_argument("--radixserve-args", default="", help="extra flags for every server")
    p.add_argument("--server-root", default=None,
                   help="serve the radixserve of this checkout (a branch's worktree) instead")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--timeout", type=float, default=1800.0, help="per request, seconds")
    p.add_argument("--output-dir", default="bench/results")
    a = p.add_argument_group("agent sessions")
    a.add_argument("--sessions", type=int, default=32)
    a.add_argument("--turns", type=int, default=8)
    a.add_argument("--system-prompt-len", type=int, default=512)
    a.add_argument("--user-len", type=int, default=64)
    a.add_argument("--tool-call-len", type=int, default=24)
    a.add_argument("--tool-result-len", type=int, default=256)
    a.add_argument("--output-len", type=int, default=24)
    a.add_argument("--think-time", type=float, default=2.0, help="seconds between turns")
    a.add_argument("--stagger", type=float, default=0.25, help="seconds between session starts")
    r = p.add_argument_group("RAG corpus")
    r.add_argument("--rag-requests", type=int, default=256)
    r.add_argument("--rag-docs", type=int, default=64)
    r.add_argument("--rag-doc-len", type=int, default=1024)
    r.add_argument("--rag-zipf", type=float, default=0.6)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    systems = args.systems.split(",")
    out = Path(args.output_dir)
    stem = time.strftime("tiers_%Y%m%d_%H%M%S")
    per: dict[str, dict[str, list[BenchSummary] | str]] = {}
    for i in range(args.runs):  # run-major: a slow spell of the machine hits every system
        for trace in build_traces(args, args.seed + i):
            row = per.setdefault(trace.name, {})
            for name in systems:
                if isinstance(row.get(name), str):
                    continue
                res = run_one(name, trace, args, out / f"{stem}_{trace.name}_{name}_{i}.log")
                if isinstance(res, str):
                    print(f"   {name} failed: {res}", flush=True)
                    row[name] = res
                else:
                    print(f"   {name}: TTFT p90 {res.ttft.p90:.2f} s, "
                          f"{res.output_throughput:.2f} tok/s, hit rate {res.hit_rate}, "
                          f"{res.failed} failed, {res.duration_s:.0f} s", flush=True)
                    runs = row.setdefault(name, [])
                    assert isinstance(runs, list)
                    runs.append(res)
    for trace_name, row in per.items():
        table = {n: (v if isinstance(v, str) else median_of(v)) for n, v in row.items()}
        print("\n" + report(trace_name, table, args.runs), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
