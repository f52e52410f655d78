"""Issue 39's CPU MoE figures: a random Qwen3-MoE in a real-ish shape, its dense twin of the
same active size, and decode / batch-16 speed against that twin and HF `generate`.

Owns: the CPU shapes (Qwen3-MoE: hidden 1024, 32 experts 512 wide, top-4, 8 layers; the dense
twin: a Llama with the same attention and an MLP top_k * 512 = 2048 wide, i.e. the parameters
one token uses), writing them as HF folders, and the timing. Does not know: the engine's
internals.

    python -m bench.moe_model write /tmp/qwen3-moe-cpu /tmp/dense-active
    python -m bench.moe_model measure /tmp/qwen3-moe-cpu /tmp/dense-active --runs 3
    python -m bench.compare --model /tmp/qwen3-moe-cpu --workload shared-prefix   # serving

`measure` runs radixserve and HF in this process, one after another per run (interleaved),
with torch's threads as given (--threads); `--clock cpu` times by this process's CPU time,
which other jobs on a shared machine inflate far less than wall time (use --threads 1).
Decode at batch 1: 64 new tokens after a 32-token prompt; batch 16: 16 prompts of 64 tokens,
64 new tokens each; tokens/s over the whole generate call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common.gpu_models import LlamaShape, save_model

MOE_CPU = LlamaShape(1024, 8, 16, 4, 3072, 32000, tied=False, experts=32, top_k=4,
                     expert_intermediate=512)
DENSE_TWIN = LlamaShape(1024, 8, 16, 4, 4 * 512, 32000, tied=False)


def write(moe_dir: Path, dense_dir: Path) -> None:
    save_model(MOE_CPU, moe_dir, 4096, device="cpu")
    save_model(DENSE_TWIN, dense_dir, 4096, device="cpu")


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _ours(model: Path, dtype: str, threads: int | None, quantization: str | None = None
          ) -> Callable[[list[list[int]], int], None]:
    from radixserve import LLM, SamplingParams

    llm = LLM(model=str(model), dtype=dtype, kv_cache_tokens=16384, disable_radix_cache=True,
              num_threads=threads, quantization=quantization)

    def run(prompts: list[list[int]], new: int) -> None:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))

    return run


def _hf(model: Path, dtype: str) -> Callable[[list[list[int]], int], None]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))

    def run(prompts: list[list[int]], new: int) -> None:
        ids = torch.tensor(prompts)  # equal lengths: no padding
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                        min_new_tokens=new, do_sample=False, pad_token_id=0)

    return run


def measure(moe_dir: Path, dense_dir: Path, runs: int, dtype: str, threads: int | None,
            clock: Callable[[], float], int8: bool = False) -> None:
    systems = {"radixserve MoE": _ours(moe_dir, dtype, threads), "radixserve dense twin":
               _ours(dense_dir, dtype, threads), "HF generate MoE": _hf(moe_dir, dtype)}
    if int8:  # --quantization int8 (experts and dense layers): an extra line, not the baseline
        systems["radixserve MoE int8"] = _ours(moe_dir, dtype, threads, "int8")
    cases = {"decode b=1": (_prompts(1, 32, 32000), 64),
             "batch 16": (_prompts(16, 64, 32000), 64)}
    rates: dict[tuple[str, str], list[float]] = {}
    for run in systems.values():  # warm-up: oneDNN primitives, allocator
        run(cases["decode b=1"][0], 4)
    for _ in range(runs):
        for case, (prompts, new) in cases.items():
            for name, run in systems.items():
                t0 = clock()
                run(prompts, new)
                rates.setdefault((case, name), []).append(len(prompts) * new / (clock() - t0))
    print(f"{dtype}, threads {torch.get_num_threads()}, median of {runs} (tokens/s)")
    for case in cases:
        ours = statistics.median(rates[(case, "radixserve MoE")])
        for name in systems:
            r = statistics.median(rates[(case, name)])
            print(f"  {case:11} {name:22} {r:9.1f} tok/s   MoE / this: {ours / r:5.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["write", "measure"])
    ap.add_argument("moe_dir", type=Path)
    ap.add_argument("dense_dir", type=Path)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--int8", action="store_true",
                    help="also radixserve with --quantization int8 (the MoE line stays bf16)")
    args = ap.parse_args(argv)
    if args.action == "write":
        write(args.moe_dir, args.dense_dir)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    measure(args.moe_dir, args.dense_dir, args.runs, args.dtype, args.threads,
            time.process_time if args.clock == "cpu" else time.perf_counter, args.int8)


if __name__ == "__main__":
    main()
