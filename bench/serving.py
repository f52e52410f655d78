"""The serving benchmark client: streams a workload at any OpenAI-compatible server.

Owns: one benchmark run (warm-up, the workload, the summary) and the `python -m bench.serving`
CLI. The HTTP side (requests, arrivals, warm-up, /metrics) is bench.common.client.
Does not know: which server it talks to (radixserve, its router, vLLM, llama.cpp, the HF
baseline), how workloads are built, how figures are defined (bench.common.metrics).

Usage: python -m bench.serving --base-url http://127.0.0.1:30000 --workload shared-prefix
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.common.client import (
    BenchError,
    BenchRun,
    ClientConfig,
    Endpoint,
    fetch_model,
    jsonable,
    run_all,
    scrape_metrics,
    warm_up,
)
from bench.common.metrics import (
    counter_hit_rate,
    format_summary,
    summarize,
)
from bench.common.workloads import (
    Workload,
    WorkloadError,
    add_workload_args,
    load_workload,
)


async def run_benchmark(cfg: ClientConfig, workload: Workload) -> BenchRun:
    """Warm up, run the workload once, and summarize; request failures are counted."""
    notes: list[str] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = await fetch_model(session, cfg)
        cfg = await warm_up(session, cfg, model, workload, notes)
        before = await scrape_metrics(session, cfg.base_url)
        start = time.perf_counter()
        results = await run_all(session, cfg, model, workload)
        duration = time.perf_counter() - start
        after = await scrape_metrics(session, cfg.base_url)
    counters = counter_hit_rate(before, after)
    summary = summarize(results, duration, counters)
    if summary.short_outputs:
        notes.append(f"{summary.short_outputs} request(s) got fewer tokens than max_tokens: "
                     "the server does not honour ignore_eos")
    return BenchRun(cfg, model, workload.describe(), results, start, summary, counters, notes)


def add_client_args(p: argparse.ArgumentParser) -> None:
    """Client flags shared by bench.serving and bench.compare (vllm bench serve's names)."""
    g = p.add_argument_group("client")
    g.add_argument("--endpoint", type=Endpoint, default=Endpoint.COMPLETIONS,
                   choices=list(Endpoint))
    g.add_argument("--served-model-name", default=None, help="default: GET /v1/models")
    g.add_argument("--api-key", default=None)
    g.add_argument("--request-rate", type=float, default=math.inf, help="inf: all at once")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    g.add_argument("--warmup", type=int, default=None,
                   help="warm-up requests (default: one per shared prefix)")
    g.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    g.add_argument("--extra-body", type=json.loads, default={},
                   help='JSON merged into every request, e.g. \'{"logit_bias": {"2": -100}}\'')
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument("--output-dir", default="bench/results")
    g.add_argument("--no-plots", action="store_true")


def client_config(args: argparse.Namespace, base_url: str) -> ClientConfig:
    return ClientConfig(
        base_url=base_url.rstrip("/"), model=args.served_model_name, endpoint=args.endpoint,
        api_key=args.api_key, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, timeout_s=args.timeout,
        ignore_eos=not args.no_ignore_eos, extra_body=args.extra_body,
        warmup=args.warmup, seed=args.seed,
        disable_tqdm=args.disable_tqdm)


def write_json(path: Path, record: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return path


def run_cli(body: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """A bench entry point's exit code: body's own, or 2 after printing a BenchError."""
    try:
        return body(args)
    except BenchError as e:
        print(f"error: {e}")
        return 2


def _main(args: argparse.Namespace) -> int:
    workload = load_workload(args)
    cfg = client_config(args, args.base_url)
    rates = [float(r) for r in args.sweep.split(",")] if args.sweep else [cfg.request_rate]
    runs: list[BenchRun] = []
    for i, rate in enumerate(rates):
        # Only the first point warms the server; later points find it warm already.
        point = replace(cfg, request_rate=rate, warmup=cfg.warmup if i == 0 else 0)
        run = asyncio.run(run_benchmark(point, workload))
        runs.append(run)
        print(format_summary(run.summary, f"{workload.kind.value} @ rate {rate} req/s"))
        for note in run.notes:
            print(f"note: {note}")
    stem = f"serving_{workload.kind.value}_{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(args.output_dir)
    paths = [write_json(out / f"{stem}.json", {"runs": [r.to_dict() for r in runs],
                                               "rates": [jsonable(r) for r in rates]})]
    if not args.no_plots:
        from bench.common import plots
        paths += plots.plot_run(runs[-1].results, out / stem)
        if len(runs) > 1:
            paths.append(plots.plot_sweep(rates, [r.summary for r in runs],
                                          out / f"{stem}_sweep.png"))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r.summary.completed for r in runs) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--sweep", default=None, help="request rates r1,r2,... (overrides the rate)")
    add_client_args(p)
    add_workload_args(p)
    args = p.parse_args(argv)
    try:
        return _main(args)
    except (BenchError, WorkloadError, ValueError) as e:
        print(f"error: {e}")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
