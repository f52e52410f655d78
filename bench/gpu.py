"""GPU throughput table (issue 28): radixserve vs HF `generate` on random-weight models in real
shapes, with the bandwidth floor and a torch.profiler view of decode steps.

Owns: the run plan (models x batch sizes), HBM bandwidth measurement, timing offline
`LLM.generate` and HF `generate`, and the JSON + markdown report. Does not know: the engine's
internals (bench/common/step_profile.py drives decode steps; gpu_models.py builds models).

    python -m bench.gpu                       # the table: 3 shapes x batch 1/16/64/256
    python -m bench.gpu --models qwen3-moe    # issue 39's MoE shape (64 experts, top-8)
    python -m bench.gpu --models smollm2-135m --batches 1,64 --no-hf   # quicker
    python -m bench.gpu --eager               # also radixserve with --enforce-eager
    python -m bench.gpu --no-overlap          # also radixserve --disable-overlap-schedule

bf16, 256 input and 128 output tokens per request, ignore_eos, greedy. Output tok/s counts
output tokens over the whole generate call (prefill included, as the issue's table did);
ms/token at batch 1 is its inverse. Needs CUDA: elsewhere it says so and exits 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common.gpu_models import SHAPES, describe, save_model, shape_named
from bench.common.step_profile import profile_decode

NO_CUDA = ("bench.gpu needs a CUDA GPU and torch.cuda.is_available() is False here; run it on "
           "a CUDA machine (bench/README.md, 'GPU figures')")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--profile-batches", default="1,64", help="decode steps under torch.profiler")
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument("--hbm-gbps", type=float, default=None, help="default: measured (a copy)")
    ap.add_argument("--llama1b-vocab", type=int, default=None,
                    help="vocabulary of the llama-1b shape (default 49152; 128256: Llama-3.2's)")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate")
    ap.add_argument("--eager", action="store_true", help="also radixserve --enforce-eager")
    ap.add_argument("--no-overlap", action="store_true",
                    help="also radixserve --disable-overlap-schedule (overlap is on by default)")
    ap.add_argument("--out-dir", default=".", help="writes bench_gpu.json and bench_gpu.md")
    return ap.parse_args(argv)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def measure_hbm_gbps() -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    import torch

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    # torch.cuda.Event.__new__ is unannotated.
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * n * 10 / (float(start.elapsed_time(end)) / 1e3) / 1e9


def free_cuda() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def prompts(batch: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, input_len), generator=gen).tolist()


def run_radixserve(path: Path, args: argparse.Namespace, vocab: int, eager: bool,
                   log: dict[str, Any], no_overlap: bool = False) -> dict[int, float]:
    """Output tok/s per batch size; the decode-step profiles go into log['profile']."""
    import torch

    from radixserve import LLM, SamplingParams

    batches = ints(args.batches)
    most = max(batches + ints(args.profile_batches))
    seq = args.input_len + args.output_len
    t0 = time.perf_counter()
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=seq + 64,
              kv_cache_tokens=most * (seq + 16) + 4096, max_running_requests=most,
              enforce_eager=eager, disable_overlap_schedule=no_overlap)
    log["startup_s"] = round(time.perf_counter() - t0, 2)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts(most, args.input_len, vocab, 1), warm)  # compile, allocate
    rates: dict[int, float] = {}
    for b in batches:
        batch = prompts(b, args.input_len, vocab, 100 + b)  # fresh: no prefix-cache hits
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(batch, params)
        torch.cuda.synchronize()
        n = sum(len(o.token_ids) for o in outs)
        assert n == b * args.output_len, (n, b)
        rates[b] = n / (time.perf_counter() - t)
    log["profile"] = [vars(profile_decode(llm, b, args.input_len, args.profile_steps, vocab,
                                          500 + b)) for b in ints(args.profile_batches)]
    del llm
    free_cuda()
    return rates


def run_hf(path: Path, args: argparse.Namespace, vocab: int) -> dict[int, float]:
    import torch
    from transformers import AutoModelForCausalLM

    # PreTrainedModel.cuda is @wraps(nn.Module.cuda); typeshed's _Wrapped is no descriptor, so
    # mypy wants `self` passed again.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = model.cuda().eval()  # type: ignore[call-arg]
    rates: dict[int, float] = {}

    def gen(batch: int, new: int, seed: int) -> None:
        ids = torch.tensor(prompts(batch, args.input_len, vocab, seed), device="cuda")
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        gen(1, 8, 1)  # warm
        for b in ints(args.batches):
            torch.cuda.synchronize()
            t = time.perf_counter()
            gen(b, args.output_len, 100 + b)
            torch.cuda.synchronize()
            rates[b] = b * args.output_len / (time.perf_counter() - t)
    return rates  # the model is freed with this frame


def bench_model(name: str, args: argparse.Namespace, hbm_gbps: float) -> dict[str, Any]:
    shape = shape_named(name, args.llama1b_vocab if name == "llama-1b" else None)
    floor_s = shape.step_weight_bytes() / (hbm_gbps * 1e9)
    result: dict[str, Any] = {"shape": describe(shape), "floor_step_ms": floor_s * 1e3,
                              "floor_tok_s_batch1": 1 / floor_s, "rows": {}}
    with tempfile.TemporaryDirectory(prefix=f"bench-gpu-{name}-") as tmp:
        path = save_model(shape, Path(tmp), args.input_len + args.output_len + 512)
        modes = [("radixserve", False, False)]
        modes += [("radixserve --enforce-eager", True, False)] if args.eager else []
        modes += ([("radixserve --disable-overlap-schedule", False, True)]
                  if args.no_overlap else [])
        for label, eager, no_overlap in modes:
            log: dict[str, Any] = {}
            rates = run_radixserve(path, args, shape.vocab, eager, log, no_overlap)
            result["rows"][label] = {"tok_s": rates, **log}
        if not args.no_hf:
            result["rows"]["HF generate"] = {"tok_s": run_hf(path, args, shape.vocab)}
            free_cuda()
    return result


def markdown(report: dict[str, Any]) -> str:
    batches = report["batches"]
    lines = [f"GPU: {report['gpu']} (torch {report['torch']}), HBM {report['hbm_gbps']:.0f} GB/s "
             f"({report['hbm_source']}); bf16, {report['input_len']} in / "
             f"{report['output_len']} out tokens, ignore_eos", "",
             "| output tok/s | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    for name, res in report["models"].items():
        for label, row in res["rows"].items():
            cells = [f"{row['tok_s'][b]:,.0f}" for b in batches]
            if 1 in batches:
                cells[0] = f"{row['tok_s'][1]:,.1f} ({1e3 / row['tok_s'][1]:.2f} ms/token)"
            lines.append(f"| {name} shape, {label} | " + " | ".join(cells) + " |")
    lines += ["", "| model | weights read per step | floor ms/step | floor tok/s at batch 1 |",
              "|---|---|---|---|"]
    for name, res in report["models"].items():
        lines.append(f"| {name} | {res['shape']['step_weight_bytes'] / 1e9:.2f} GB | "
                     f"{res['floor_step_ms']:.2f} | {res['floor_tok_s_batch1']:,.0f} |")
    lines += ["", "| decode steps (torch.profiler) | batch | ms/step | GPU busy | kernels/step "
              "| host launches/step |", "|---|---|---|---|---|---|"]
    for name, res in report["models"].items():
        for label, row in res["rows"].items():
            for p in row.get("profile", []):
                lines.append(f"| {name}, {label} | {p['batch']} | {p['step_ms']:.2f} | "
                             f"{p['gpu_busy']:.0%} | {p['kernels_per_step']:.0f} | "
                             f"{p['launches_per_step']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    unknown = [m for m in args.models.split(",") if m not in SHAPES]
    if unknown:
        print(f"bench.gpu: unknown model shape {unknown[0]!r}; known: {', '.join(SHAPES)}",
              file=sys.stderr)
        return 2
    hbm = args.hbm_gbps or measure_hbm_gbps()
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm_gbps": hbm,
        "hbm_source": "given" if args.hbm_gbps else "measured, 1 GiB copy",
        "batches": ints(args.batches), "input_len": args.input_len,
        "output_len": args.output_len, "models": {}}
    for name in args.models.split(","):
        report["models"][name] = bench_model(name, args, hbm)
        print(f"bench.gpu: {name} done", file=sys.stderr, flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / "bench_gpu.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
