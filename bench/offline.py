"""Offline throughput: LLM.generate against HF's generate, and the radix cache on vs off.

The cache on vs off on a shared-prefix workload. Side by side in one run; ratios printed.

    python -m bench.offline                      # all sections, default model
    python -m bench.offline --section shared --runs 3
    python -m bench.offline --section hf --dtypes bfloat16,float32

Prompts are random token ids (exact lengths); outputs are forced to full length (ignore_eos /
min_new_tokens) so both sides generate the same number of tokens.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from radixserve import LLM
from radixserve.model_source import resolve_model
from radixserve.types import SamplingParams


def rand_ids(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def timed(fn: Callable[[], int], runs: int) -> tuple[float, float]:
    """(median tokens/s, median seconds) over `runs` calls of fn (which returns tokens)."""
    rates, secs = [], []
    for _ in range(runs):
        t = time.perf_counter()
        n = fn()
        dt = time.perf_counter() - t
        rates.append(n / dt)
        secs.append(dt)
    return statistics.median(rates), statistics.median(secs)


def generated_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> int:
    return sum(len(r.token_ids) for r in llm.generate(prompts, params))


def hf_generate(model_dir: str, dtype: torch.dtype) -> Callable[[list[list[int]], int], int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)

    def run(prompts: list[list[int]], n: int) -> int:
        width = max(len(p) for p in prompts)
        pad = hf.config.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=pad)
        return int(out.shape[1] - width) * len(prompts)

    return run


def section_hf(model: str, dtypes: list[str], runs: int, out_len: int) -> list[list[str]]:
    g = torch.Generator().manual_seed(0)
    single = [rand_ids(128, g)]
    mixed = [rand_ids(int(n), g) for n in torch.randint(16, 512, (32,), generator=g)]
    rows: list[list[str]] = []
    hf_dir = str(resolve_model(model).hf_dir)
    for dtype in dtypes:
        rows += _compare_dtype(model, hf_dir, dtype, runs, out_len, single, mixed)
        gc.collect()
    return rows


def _compare_dtype(model: str, hf_dir: str, dtype: str, runs: int, out_len: int,
                   single: list[list[int]], mixed: list[list[int]]) -> list[list[str]]:
    llm = LLM(model=model, dtype=dtype, disable_radix_cache=True)
    hf = hf_generate(hf_dir, getattr(torch, dtype))
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    rows = []
    # HF runs "1 prompt" alone and "32 mixed" as one left-padded batch of 32.
    for name, prompts in (("1 prompt", single), ("32 mixed", mixed)):
        ours, _ = timed(partial(generated_tokens, llm, prompts, params), runs)
        theirs, _ = timed(partial(hf, prompts, out_len), runs)
        rows.append([dtype, name, f"{ours:.1f}", f"{theirs:.1f}", f"{ours / theirs:.2f}x"])
    return rows


def section_shared(model: str, dtype: str, runs: int, groups: int, per_group: int,
                   system_len: int, question_len: int, out_len: int) -> list[list[str]]:
    g = torch.Generator().manual_seed(1)
    systems = [rand_ids(system_len, g) for _ in range(groups)]
    prompts = [s + rand_ids(question_len, g) for s in systems for _ in range(per_group)]
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    rows, base = [], None
    for label, disable in (("cache off", True), ("cache on", False)):
        llm = LLM(model=model, dtype=dtype, disable_radix_cache=disable)
        llm.generate([rand_ids(64, g)], params)  # warm-up (allocator, kernels), unrelated prompt
        rates, ttfts, hits = [], [], []
        for _ in range(runs):
            llm.engine.flush_cache()  # cold cache each run: sharing happens within the batch
            t = time.perf_counter()
            res = llm.generate(prompts, params)
            dt = time.perf_counter() - t
            rates.append(sum(len(r.token_ids) for r in res) / dt)
            ttfts.append(statistics.mean(r.ttft for r in res))
            hits.append(sum(r.num_cached_tokens for r in res) / sum(r.num_prompt_tokens for r in res))
        rate, ttft = statistics.median(rates), statistics.median(ttfts)
        base = base or (rate, ttft)
        rows.append([label, f"{rate:.1f}", f"{ttft:.3f}", f"{statistics.median(hits):.1%}",
                     f"{rate / base[0]:.2f}x", f"{base[1] / ttft:.2f}x"])
        del llm
        gc.collect()
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]

    def line(r: list[str]) -> str:
        return "  ".join(x.rjust(w) for x, w in zip(r, widths, strict=True))

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--section", choices=["all", "hf", "shared"], default="all")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=64)
    args = ap.parse_args()
    if args.section in ("all", "hf"):
        rows = section_hf(args.model, args.dtypes.split(","), args.runs, args.output_len)
        print(f"torch threads (set by the engine, shared by HF): {torch.get_num_threads()}")
        print("\nLLM.generate vs HF generate (output tokens/s, median of runs)")
        print(table(["dtype", "workload", "radixserve", "HF", "ratio"], rows))
    if args.section in ("all", "shared"):
        rows = section_shared(args.model, args.dtypes.split(",")[0], args.runs, args.groups,
                              args.prompts_per_group, args.system_len, args.question_len,
                              args.output_len)
        print(f"torch threads: {torch.get_num_threads()}")
        print(f"\nshared prefix: {args.groups} groups x {args.prompts_per_group} prompts, "
              f"{args.system_len}-token system prompt, {args.question_len}-token question, "
              f"{args.output_len} output tokens, all at once")
        print(table(["radixserve", "out tok/s", "mean TTFT s", "hit rate", "throughput",
                     "TTFT speed-up"], rows))


if __name__ == "__main__":
    main()
