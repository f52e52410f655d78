"""Speculative decoding on vs off, side by side in one run: speed and identical outputs.

Output tok/s (median of N runs),
the on/off ratio, the mean accepted length, and whether the greedy outputs are the same.

Owns: the cases (extractive RAG at several batch sizes, a code edit with `prediction`, agent
tool-call JSON under a named tool choice), the two servers they run against (`radixserve
serve` without and with `--speculative-config`, both up for the whole run so every repetition
alternates between them and a slow spell of a shared machine hits both alike), and the table.
Does not know: the prompts (bench.common.spec_workloads), how the engine drafts or verifies.
The no-regression runs (random, shared-prefix) are bench.compare's, with
`--speculative-config` adding the system `radixserve-spec`; `--section compare` runs them.

Usage: python -m bench.spec --runs 3
       python -m bench.spec --section rag --rag-batches 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import spec_workloads as w
from bench.common.client import BenchError
from bench.common.metrics import parse_prometheus
from bench.common.server_process import ServerProcess, SystemSpec
from bench.serving import run_cli, write_json

OFF, ON = "off", "spec"
DEFAULT_SPEC = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                '"prompt_lookup_min": 2}')
SPEC_PREFIX = "radixserve:spec_decode_"
Body = dict[str, Any]


@dataclass(frozen=True)
class Variant:
    label: str
    server: str  # OFF or ON
    transform: Callable[[int, Body], Body] = lambda i, b: b  # request index, body -> body


@dataclass(frozen=True)
class Case:
    name: str
    bodies: tuple[Body, ...]
    concurrency: int
    variants: tuple[Variant, ...]  # the first is the baseline of the ratios


@dataclass
class CaseRun:
    tokens: int
    seconds: float
    texts: list[str]
    errors: list[str]
    usage: dict[str, int]  # summed completion_tokens_details
    counters: dict[str, float]  # deltas of the server's spec_decode counters

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _answer(choice: dict[str, Any]) -> str:
    msg = choice.get("message") or {}
    calls = msg.get("tool_calls") or []
    return (msg.get("content") or "") + "".join(
        c["function"]["name"] + c["function"]["arguments"] for c in calls)


async def _post(session: aiohttp.ClientSession, url: str, body: Body) -> dict[str, Any]:
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        data: dict[str, Any] = await resp.json(content_type=None)
        if resp.status != 200:
            raise BenchError(f"HTTP {resp.status}: {json.dumps(data)[:300]}")
        return data


async def _counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return {k: v for k, v in parse_prometheus(text).items() if k.startswith(SPEC_PREFIX)}


async def run_case(url: str, bodies: Sequence[Body], concurrency: int) -> CaseRun:
    """All `bodies`, at most `concurrency` in flight; wall time from first send to last reply."""
    gate = asyncio.Semaphore(concurrency)
    texts, errors = [""] * len(bodies), []
    usage: dict[str, int] = {}
    tokens = 0
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url + "/flush_cache") as resp:  # no draft from earlier runs
            await resp.read()
        before = await _counters(session, url)

        async def one(i: int, body: Body) -> None:
            nonlocal tokens
            async with gate:
                try:
                    data = await _post(session, url, body)
                except (BenchError, aiohttp.ClientError) as e:
                    errors.append(str(e))
                    return
            texts[i] = _answer(data["choices"][0])
            tokens += data["usage"]["completion_tokens"]
            for k, v in (data["usage"].get("completion_tokens_details") or {}).items():
                usage[k] = usage.get(k, 0) + int(v or 0)

        start = time.perf_counter()
        await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
        seconds = time.perf_counter() - start
        after = await _counters(session, url)
    deltas = {k: after[k] - before.get(k, 0.0) for k in after}
    return CaseRun(tokens, seconds, texts, errors, usage, deltas)


def mean_accepted_length(counters: dict[str, float], usage: dict[str, int]) -> float | None:
    """Tokens per verification step, as vLLM reports it: 1 + accepted / drafts."""
    drafts = counters.get(SPEC_PREFIX + "num_drafts_total")
    accepted = counters.get(SPEC_PREFIX + "num_accepted_tokens_total")
    if drafts and accepted is not None:
        return 1 + accepted / drafts
    return None


@dataclass
class Row:
    case: str
    variant: str
    runs: list[CaseRun] = field(default_factory=list)

    def median_tok_s(self) -> float:
        return statistics.median(r.tok_s for r in self.runs)


def build_cases(args: argparse.Namespace, model: str, code_answers: Sequence[str]) -> list[Case]:
    off, on = Variant("off", OFF), Variant("on", ON)
    cases: list[Case] = []
    if "rag" in args.section:
        rag = [w.rag_body(model, doc, what) for doc, what in w.RAG_SET]
        # A batch larger than the set repeats it: every slot of the batch stays busy.
        cases += [Case(f"rag b={b}", tuple(rag * -(-b // len(rag))), b, (off, on))
                  for b in args.rag_batches]
    if "code" in args.section:
        preds = [w.predicted(a) for a in code_answers]
        code = tuple(w.code_body(model, src) for src in w.CODE_FILES)
        cases.append(Case("code edit", code, 1, (
            off, Variant("prediction", OFF, lambda i, b: w.with_prediction(b, preds[i])),
            Variant("prediction+on", ON, lambda i, b: w.with_prediction(b, preds[i])))))
    if "tools" in args.section:
        tools = tuple(w.tool_body(model, q) for q in w.TOOL_QUESTIONS)
        cases.append(Case("tool-call JSON", tools, 1, (off, on)))
    return cases


async def _reference_answers(url: str, model: str) -> list[str]:
    """Greedy answers of the code set without speculation: what the predictions are made of."""
    run = await run_case(url, [w.code_body(model, s) for s in w.CODE_FILES], 1)
    if run.errors:
        raise BenchError(f"reference answers failed: {run.errors[0]}")
    return run.texts


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def report(rows: dict[tuple[str, str], Row], cases: list[Case]) -> str:
    header = ["case", "variant", "out tok/s", "ratio", "mean acc len", "same text", "errors"]
    table = [header]
    for case in cases:
        base = rows[(case.name, case.variants[0].label)]
        for v in case.variants:
            row = rows[(case.name, v.label)]
            last = row.runs[-1]
            same = sum(a == b for a, b in zip(last.texts, base.runs[-1].texts, strict=True))
            acc = [x for r in row.runs if (x := mean_accepted_length(r.counters, r.usage))]
            table.append([case.name, v.label, _fmt(row.median_tok_s()),
                          f"{row.median_tok_s() / base.median_tok_s():.2f}x",
                          _fmt(statistics.median(acc) if acc else None, ".2f"),
                          f"{same}/{len(last.texts)}",
                          str(sum(len(r.errors) for r in row.runs))])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.rjust(wd) if i > 1 else c.ljust(wd) for i, (c, wd)
                       in enumerate(zip(r, widths, strict=True))) for r in table]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


async def run_all(urls: dict[str, str], args: argparse.Namespace, model: str
                  ) -> tuple[list[Case], dict[tuple[str, str], Row]]:
    answers = await _reference_answers(urls[OFF], model) if "code" in args.section else []
    for a in answers:
        print(f"code edit: prediction covers {w.overlap(w.predicted(a), a):.0%} of the answer",
              flush=True)
    cases = build_cases(args, model, answers)
    for url in urls.values():  # warm-up: first-request costs off the clock
        await run_case(url, [w.rag_body(model, *w.RAG_SET[0])], 1)
    rows = {(c.name, v.label): Row(c.name, v.label) for c in cases for v in c.variants}
    for r in range(args.runs):
        for case in cases:
            for v in case.variants:
                bodies = [v.transform(i, b) for i, b in enumerate(case.bodies)]
                run = await run_case(urls[v.server], bodies, case.concurrency)
                rows[(case.name, v.label)].runs.append(run)
                print(f"run {r + 1}/{args.runs} {case.name} {v.label}: {run.tok_s:.1f} tok/s "
                      f"({run.tokens} tokens, {run.seconds:.1f} s, errors {len(run.errors)}) "
                      f"{run.counters or ''}", flush=True)
    return cases, rows


def _serve(args: argparse.Namespace, extra: Sequence[str]) -> SystemSpec:
    return SystemSpec("radixserve-spec" if extra else "radixserve", (
        sys.executable, "-m", "radixserve", "serve", "--model", args.model, "--host",
        "127.0.0.1", "--port", "{port}", *args.radixserve_args.split(), *extra),
        startup_timeout_s=args.startup_timeout)


def _main(args: argparse.Namespace) -> int:
    from radixserve.model_source import resolve_model

    model = resolve_model(args.model).name
    out = Path(args.output_dir)
    stem = f"spec_{time.strftime('%Y%m%d-%H%M%S')}"
    if "compare" in args.section:
        _run_compare(args)
    args.section = [s for s in args.section if s != "compare"]
    if not args.section:
        return 0
    # An empty --speculative-config starts the "on" server without the flag (a dry run of
    # the harness on an engine without speculation: every ratio should then be ~1).
    flag = ["--speculative-config", args.speculative_config] if args.speculative_config else []
    with ServerProcess(_serve(args, []), out / f"{stem}_off.log") as off, \
            ServerProcess(_serve(args, flag), out / f"{stem}_on.log") as on:
        cases, rows = asyncio.run(run_all({OFF: off.base_url, ON: on.base_url}, args, model))
    print(f"\nspeculative config: {args.speculative_config}; median of {args.runs} run(s)")
    print(report(rows, cases))
    record = {"speculative_config": args.speculative_config, "runs": args.runs,
              "rows": [{"case": r.case, "variant": r.variant,
                        "tok_s": [x.tok_s for x in r.runs], "tokens": [x.tokens for x in r.runs],
                        "counters": [x.counters for x in r.runs],
                        "usage": [x.usage for x in r.runs], "texts": r.runs[-1].texts,
                        "errors": [e for x in r.runs for e in x.errors]}
                       for r in rows.values()]}
    print("wrote", write_json(out / f"{stem}.json", record))
    return 0


def _run_compare(args: argparse.Namespace) -> None:
    from bench import compare

    for workload in ("random", "shared-prefix"):
        compare.main(["--workload", workload, "--systems", "radixserve,radixserve-spec",
                      "--runs", str(args.runs), "--interleave", "--no-plots",
                      "--speculative-config", args.speculative_config,
                      "--radixserve-args", args.radixserve_args, "--model", args.model])


SECTIONS = ("rag", "code", "tools", "compare")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", default="rag,code,tools",
                   type=lambda s: [x for x in s.split(",") if x],
                   help=f"comma-separated of {', '.join(SECTIONS)} (compare: bench.compare "
                        "random and shared-prefix, speculation on vs off)")
    p.add_argument("--runs", type=int, default=3, help="repetitions; the median is reported")
    p.add_argument("--speculative-config", default=DEFAULT_SPEC,
                   help="the JSON of the 'on' server's --speculative-config")
    p.add_argument("--rag-batches", default=[1, 8],
                   type=lambda s: [int(x) for x in s.split(",")],
                   help="concurrency of the RAG set, one case each")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--radixserve-args", default="", help="extra flags for both servers")
    p.add_argument("--output-dir", default="bench/results")
    p.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="seconds a server may take to become healthy")
    args = p.parse_args(argv)
    unknown = set(args.section) - set(SECTIONS)
    if unknown or args.runs < 1:
        p.error(f"unknown sections {sorted(unknown)}" if unknown else "--runs must be >= 1")
    return run_cli(_main, args)


if __name__ == "__main__":
    raise SystemExit(main())
