"""Compile every kernel ahead of time for NVIDIA GPUs, on a machine that has none.

Owns: the kernels' launch signatures for an offline compile (Triton frontend, lowering, and
ptxas to a cubin) at the wrappers' own block sizes, and a register/spill report. The CPU
interpreter accepts code the compiler rejects (dot shape minimums, type rules, constexpr
misuse), so CPU-only CI runs this too (tests/triton_kernels/test_kernels.py, in a subprocess).
Does not know: what the kernels compute.

    python -m triton_kernels.aot_check --arch 90 80 [--spills] [--jobs N]

Must run with TRITON_INTERPRET unset: the compiler needs @triton.jit functions, not the
interpreter's stand-ins. Uses triton internals (ASTSource, GPUTarget, get_ptxas).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from triton_kernels.aot_gemm import gemm_launches
from triton_kernels.aot_launches import CASES, FUSED_KERNELS, Launch, fused_launches, launches


def every_launch() -> Iterator[tuple[Launch, str]]:
    """Every compile, with what its report line names besides the kernel."""
    for case in CASES:
        dtype = str(case.dtype).removeprefix("torch.")
        kv = str(case.kv_dtype or case.dtype).removeprefix("torch.")
        for launch in launches(case) + fused_launches(case):
            yield launch, f"{dtype:<9} kv={kv:<13} d={case.head_dim:<4} group={case.group}"
    for launch, label in gemm_launches():
        yield launch, label


def compile_one(launch: Launch, arch: int) -> Any:
    names = launch.kernel.arg_names
    signature = {n: "constexpr" if n in launch.constexprs else launch.types[n] for n in names}
    src = ASTSource(launch.kernel, signature, constexprs=launch.constexprs)
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages,
               "enable_fp_fusion": launch.kernel not in FUSED_KERNELS}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def register_report(ptx: str, arch: int) -> str:
    """ptxas -v on the kernel's PTX: registers per thread and spill stores."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        suffix = "a" if arch >= 90 else ""
        log = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}{suffix}", "-v", src,
                              "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return f"regs={regs.group(1) if regs else '?'} spill_bytes={spills.group(1) if spills else '?'}"


def report_line(index: int, arch: int, spills: bool) -> str:
    """Compile the index-th of every_launch() (a worker rebuilds the list: kernels do not
    pickle) and its line of the report."""
    launch, label = list(every_launch())[index]
    compiled = compile_one(launch, arch)
    line = (f"sm_{arch} {launch.kernel.__name__:<22} {label} "
            f"warps={launch.num_warps} shared={compiled.metadata.shared}")
    return line + (" " + register_report(compiled.asm["ptx"], arch) if spills else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="compile every kernel for NVIDIA targets")
    parser.add_argument("--arch", type=int, nargs="+", default=[90], help="e.g. 90 (H100) 80")
    parser.add_argument("--spills", action="store_true", help="report registers and spills")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the compiler needs compiled kernels", file=sys.stderr)
        return 2
    count = len(list(every_launch()))
    todo = [(i, arch, args.spills) for arch in args.arch for i in range(count)]
    if args.jobs <= 1:
        for item in todo:
            print(report_line(*item), flush=True)
        return 0
    # fork: the workers start with triton and the kernels imported (no GPU, no CUDA context)
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        for line in pool.map(report_line, *zip(*todo, strict=True)):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
