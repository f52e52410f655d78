"""Warm restart and the shared tier, end to end on the default model (issue 21's must-show).

    python -m bench.tier_restart                    # 16 sessions x 4 turns, median of 1
    python -m bench.tier_restart --runs 3
    python -m bench.tier_restart --kv-cache-memory-bytes 2G --sessions 20 \
        --tool-result-len 1024 --systems restart      # a 2 GB pool's warm restart

One run, each step a fresh `radixserve serve` on one agent trace (bench/common/tier_workloads.py):
  1. `first`: --kv-offload-dir L --kv-shared-dir S; every session's turns 1..T-1, as the
     agent bench plays them; then SIGTERM (a clean exit persists the pool into the tiers).
  2. `cold`: no tier: every session's turn T (the baseline: its history is recomputed).
  3. `restart`: --kv-offload-dir L only (the same process restarted): turn T.
  4. `replica`: --kv-shared-dir S only (another replica that never saw the trace): turn T.
Restart and replica each read only the directory their claim is about, so neither sees what
the other wrote. `--systems` picks which of the three run (the first server writes the shared
tier only when `replica` is among them). The stop is timed: its clean exit writes every block
of the pool within --kv-offload-shutdown-timeout (`--shutdown-timeout`) or logs how many it
dropped; the report gives the seconds, the blocks dropped and the local tier's size after it. Per system: TTFT p50/p90 of the turn-T requests, cached_tokens / history
(history = the session's turn T-1 prompt, all that any earlier process could have stored),
and how many greedy outputs are the same text as cold's (exactness across processes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from bench.common.client import BenchError, ClientConfig, fetch_model, send_request
from bench.common.metrics import RequestResult
from bench.common.server_process import ServerProcess, SystemSpec
from bench.common.tier_workloads import AgentSpec, Session, build_agent_sessions, run_agent_sessions

STOP_TIMEOUT_S = 300.0  # a clean exit writes the whole pool to the tier first


@dataclass(frozen=True)
class TurnStats:
    ttft_p50: float
    ttft_p90: float
    cached_frac_min: float  # cached_tokens / history, the worst session
    cached_frac_median: float
    same_text: int  # outputs identical to the cold server's
    failed: int


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


@dataclass(frozen=True)
class Shutdown:
    seconds: float  # SIGTERM to exit
    persist_s: float  # the engine's own figure: every pending block written (nan: none)
    dropped: int  # block writes the first server logged as not done in time
    local_bytes: int  # the local tier's block files after it


DROPPED = re.compile(r"KV tiers: (\d+) block writes not done")
PERSISTED = re.compile(r"KV tiers: every pending block written in ([\d.]+) s")


def server_argv(args: argparse.Namespace, *tier_flags: str) -> tuple[str, ...]:
    pool = (("--kv-cache-memory-bytes", args.kv_cache_memory_bytes) if args.kv_cache_memory_bytes
            else ("--kv-cache-tokens", str(args.kv_cache_tokens)))
    return (sys.executable, "-m", "radixserve", "serve", "--model", args.model, "--host",
            "127.0.0.1", "--port", "{port}", *pool, "--kv-offload-shutdown-timeout",
            str(args.shutdown_timeout), *shlex.split(args.radixserve_args), *tier_flags)


def shutdown_stats(seconds: float, log: Path, local: Path) -> Shutdown:
    text = log.read_text(errors="replace") if log.exists() else ""
    persisted = PERSISTED.findall(text)
    size = sum(p.stat().st_size for p in local.glob("*.kvb"))
    return Shutdown(seconds, float(persisted[-1]) if persisted else math.nan,
                    sum(int(n) for n in DROPPED.findall(text)), size)


def stop_cleanly(server: ServerProcess) -> None:
    """SIGTERM and wait for the persist (ServerProcess's own exit waits only 30 s)."""
    assert server.proc is not None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGTERM)
    try:
        server.proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"{server.spec.name} did not exit within {STOP_TIMEOUT_S:.0f} s") from e


async def _first(base_url: str, sessions: list[Session], spec: AgentSpec) -> None:
    cfg = ClientConfig(base_url, timeout_s=1800, disable_tqdm=True)
    earlier = [replace(s, prompts=s.prompts[:-1], prompt_lens=s.prompt_lens[:-1])
               for s in sessions]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        results = await run_agent_sessions(http, cfg, await fetch_model(http, cfg), earlier,
                                           spec)
    if bad := [r.error for r in results if not r.ok]:
        raise BenchError(f"first server: {len(bad)} failed, e.g. {bad[0]}")


async def _last_turn(base_url: str, sessions: list[Session], spec: AgentSpec,
                     concurrency: int) -> list[RequestResult]:
    cfg = ClientConfig(base_url, timeout_s=1800, disable_tqdm=True)
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        model = await fetch_model(http, cfg)

        async def one(s: Session) -> RequestResult:
            async with gate:
                return await send_request(http, cfg, model, s.prompts[-1], s.prompt_lens[-1],
                                          spec.output_len)

        return list(await asyncio.gather(*(one(s) for s in sessions)))


def turn_stats(results: list[RequestResult], sessions: list[Session],
               cold: list[RequestResult] | None) -> TurnStats:
    ok = [(r, s) for r, s in zip(results, sessions, strict=True) if r.ok]
    if not ok:
        raise BenchError("every turn-T request failed")
    ttfts = [r.ttft for r, _ in ok if r.ttft is not None]
    fracs = [(r.cached_tokens or 0) / s.prompt_lens[-2] for r, s in ok]
    ref = cold or results
    same = sum(r.ok and r.text == c.text for r, c in zip(results, ref, strict=True))
    return TurnStats(quantile(ttfts, 0.5), quantile(ttfts, 0.9), min(fracs),
                     statistics.median(fracs), same, len(results) - len(ok))


def one_run(args: argparse.Namespace, run: int, stem: str
            ) -> tuple[dict[str, TurnStats], Shutdown]:
    spec = AgentSpec(args.sessions, args.turns, args.system_prompt_len, args.user_len,
                     args.tool_call_len, args.tool_result_len, args.output_len,
                     args.think_time, args.stagger)
    from radixserve.model_source import resolve_model
    from radixserve.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(args.model).hf_dir)
    sessions = build_agent_sessions(spec, tok, args.seed + run)
    root = Path(tempfile.mkdtemp(prefix="tier-restart-", dir=args.tier_parent))
    local, shared = root / "local", root / "shared"
    out = Path(args.output_dir)
    plan = {"cold": (), "restart": ("--kv-offload-dir", str(local)),
            "replica": ("--kv-shared-dir", str(shared))}
    plan = {name: flags for name, flags in plan.items() if name in args.systems}
    first_flags = ("--kv-offload-dir", str(local)) + (
        ("--kv-shared-dir", str(shared)) if "replica" in plan else ())
    first_log = out / f"{stem}_first_{run}.log"
    try:
        first = ServerProcess(SystemSpec("first", server_argv(args, *first_flags)), first_log)
        print(f"== run {run}: first ({spec.num_sessions} sessions x {spec.num_turns - 1} "
              "turns)", flush=True)
        with first:
            asyncio.run(_first(first.base_url, sessions, spec))
            t0 = time.perf_counter()
            stop_cleanly(first)
            down = shutdown_stats(time.perf_counter() - t0, first_log, local)
            print(f"   stopped cleanly in {down.seconds:.1f} s (pool written in "
                  f"{down.persist_s:.1f} s): {down.dropped} block writes "
                  f"dropped, local tier {down.local_bytes / 2**30:.2f} GiB", flush=True)
        stats: dict[str, TurnStats] = {}
        cold: list[RequestResult] | None = None
        for name, flags in plan.items():
            with ServerProcess(SystemSpec(name, server_argv(args, *flags)),
                               out / f"{stem}_{name}_{run}.log") as server:
                results = asyncio.run(_last_turn(server.base_url, sessions, spec,
                                                 args.concurrency))
            stats[name] = turn_stats(results, sessions, cold)
            cold = cold or results
            print(f"   {name}: {stats[name]}", flush=True)
        return stats, down
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(runs: list[dict[str, TurnStats]], downs: list[Shutdown], n_sessions: int) -> str:
    down = Shutdown(*(statistics.median(getattr(d, f) for d in downs)
                      for f in Shutdown.__dataclass_fields__))
    lines = [f"median of {len(runs)} run(s), {n_sessions} sessions; the first server's clean "
             f"stop: {down.seconds:.1f} s (pool written in {down.persist_s:.1f} s), "
             f"{down.dropped:g} block writes dropped, local tier "
             f"{down.local_bytes / 2**30:.2f} GiB",
             "", "| system | TTFT p50 s | TTFT p90 s | cached/history min | median | "
             "same text as cold | failed |", "|---|---|---|---|---|---|---|"]
    med: dict[str, TurnStats] = {}
    for name in runs[0]:
        vals = [r[name] for r in runs]
        med[name] = TurnStats(*(statistics.median(getattr(v, f) for v in vals)
                                for f in TurnStats.__dataclass_fields__))
        m = med[name]
        lines.append(f"| {name} | {m.ttft_p50:.3g} | {m.ttft_p90:.3g} | "
                     f"{m.cached_frac_min:.3f} | {m.cached_frac_median:.3f} | "
                     f"{m.same_text:g}/{n_sessions} | {m.failed:g} |")
    for name in ("restart", "replica"):
        if "cold" in med and name in med:
            lines.append(f"TTFT p50 cold/{name}: "
                         f"{med['cold'].ttft_p50 / med[name].ttft_p50:.2f}x")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--kv-cache-memory-bytes", default=None,
                   help="the pool's size in bytes instead (e.g. 2G)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="--kv-offload-shutdown-timeout of the first server")
    p.add_argument("--systems", default="cold,restart,replica",
                   type=lambda v: [x for x in v.split(",") if x],
                   help="which of cold,restart,replica serve turn T")
    p.add_argument("--concurrency", type=int, default=4, help="turn-T requests in flight")
    p.add_argument("--tier-parent", default=None, help="where tier dirs go (default $TMPDIR)")
    p.add_argument("--radixserve-args", default="", help="extra flags for every server")
    p.add_argument("--output-dir", default="bench/results")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompt-len", type=int, default=512)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--tool-call-len", type=int, default=24)
    p.add_argument("--tool-result-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--think-time", type=float, default=0.5)
    p.add_argument("--stagger", type=float, default=0.1)
    args = p.parse_args(argv)
    if args.turns < 2:
        p.error("--turns must be >= 2 (turns 1..T-1 before the restart, T after)")
    if not args.systems or set(args.systems) - {"cold", "restart", "replica"}:
        p.error("--systems: a comma list of cold, restart, replica")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stem = time.strftime("tier_restart_%Y%m%d_%H%M%S")
    done = [one_run(args, i, stem) for i in range(args.runs)]
    print("\n" + report([r for r, _ in done], [d for _, d in done], args.sessions), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
