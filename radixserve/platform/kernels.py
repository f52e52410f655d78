"""The native CPU extensions, the tier each runs at, and `--check-builds`.

Owns: `EXTENSIONS`, the table of every native extension (its sources, flags and ops),
`load_extension` (the ops of an extension at the process's tier: the best the CPU executes,
capped by $RADIXSERVE_CPU_ISA; a failed build falls back to the next lower tier that builds,
or to torch, with one warning), `kernel_tier_line` (what the start-up log and /server_info
say) and the command `python -m radixserve.platform.kernels --check-builds`, which compiles
every extension for every tier whatever the host (compile-only) and prints the table.
Does not know: what the ops compute, their torch fallbacks (the modules that load them).

Adding an extension (its sources under radixserve/<package>/csrc):
  1. In the C++, register the ops with `TORCH_LIBRARY_FRAGMENT(RADIXSERVE_OPS_NS, m)` and
     `TORCH_LIBRARY_IMPL(RADIXSERVE_OPS_NS, CPU, m)`: each tier's build defines the namespace
     (radixserve_portable, radixserve_avx2, ...). Guard intrinsics by what the tier's -march
     defines (`__AVX2__`, `__AVX512F__`, `__AVX512BF16__`, `__AMX_BF16__`) with a plain C++
     path under none of them: every tier must compile (the --check-builds test fails CI
     otherwise, on any machine).
  2. Add a `NativeExtension(name, sources, what, ops, cflags)` to EXTENSIONS below (the
     check-builds table and its test pick it up) and give it a name constant.
  3. Load it where it is used: `loaded = load_extension(MY_EXT)`; None means the torch path;
     else `loaded.op("my_op")` is the callable (torch.ops.radixserve_<tier>.my_op).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.platform.cpu_isa import CpuIsa, TierChoice, choose_tier, ops_namespace
from radixserve.platform.native_build import (
    ENV_RETRY,
    BuildOutcome,
    NativeExtension,
    build_extension,
)

logger = logging.getLogger(__name__)

ENV_DISABLE = "RADIXSERVE_NO_CPU_KERNELS"  # "1": skip the native kernels (the torch path)

_ROOT = Path(__file__).resolve().parent.parent  # the radixserve package
_ATTN = _ROOT / "attention" / "csrc"
_MODEL = _ROOT / "model" / "csrc"

ATTENTION = NativeExtension(
    "radixserve_cpu_attention",
    tuple(_ATTN / n for n in ("paged_decode.cpp", "paged_decode_fp8.cpp",
                              "paged_decode_fp8_amx.cpp", "paged_decode_fp8_avx512.cpp",
                              "paged_decode_fp8_bf16.cpp",
                              "prefill_attention.cpp", "prefill_attention_bf16.cpp")),
    "CPU attention kernels", ("paged_decode", "prefill_attention"))
INT8_GEMM = NativeExtension(
    "radixserve_int8_gemm", (_MODEL / "int8_packed_gemm.cpp",), "CPU int8 GEMM kernel",
    ("int8_packed_gemm", "int8_packed_gemm_uses_bf16"))
# No -ffast-math and no FMA contraction: the ops must round product by product as torch does
NORM_ROPE = NativeExtension(
    "radixserve_norm_rope", (_MODEL / "norm_rope.cpp",), "CPU RMSNorm/RoPE kernels",
    ("rms_norm", "rope_qk", "rope_store"), cflags=("-O3", "-fopenmp", "-ffp-contract=off"),
    header_dirs=(_ATTN,))  # bf16_access.h

QUANT_GEMM = NativeExtension(
    "radixserve_quant_gemm", (_MODEL / "quant_gemm.cpp",), "CPU quantized GEMM kernel",
    ("quant_gemm", "quant_dequantize"))

MOE_EXPERTS = NativeExtension(
    "radixserve_moe_experts",
    (_MODEL / "moe" / "moe_experts.cpp", _MODEL / "moe" / "moe_quant.cpp"),
    "CPU mixture-of-experts kernel", ("moe_experts", "moe_experts_quant"),
    header_dirs=(_ATTN, _MODEL))  # bf16_access.h, vec_math.h; quant_gemm_simd.h

# No -ffast-math: its NaN tests must stay
SAMPLING = NativeExtension(
    "radixserve_cpu_sampling", (_ROOT / "engine" / "csrc" / "greedy.cpp",),
    "CPU greedy sampling kernel", ("greedy_argmax",), cflags=("-O3", "-fopenmp"))

# No -ffast-math: each output's sum is in the order written, the same for every batch size
PANEL_GEMM = NativeExtension(
    "radixserve_panel_gemm", (_MODEL / "panel_gemm.cpp",), "CPU panel GEMM kernel",
    ("panel_linear", "panel_width"), cflags=("-O3", "-fopenmp", "-ffp-contract=off"),
    header_dirs=(_ATTN,))  # bf16_access.h

EXTENSIONS: tuple[NativeExtension, ...] = (ATTENTION, INT8_GEMM, NORM_ROPE, QUANT_GEMM,
                                           MOE_EXPERTS, SAMPLING, PANEL_GEMM)
# What every source above includes: --check-builds precompiles it once per tier
PRELUDE = ("ATen/ATen.h",)


@dataclass(frozen=True)
class LoadedExtension:
    """An extension's ops as built for `tier` (torch.ops.radixserve_<tier>)."""

    ext: NativeExtension
    tier: CpuIsa

    def op(self, name: str) -> Callable[..., Any]:
        import torch

        fn: Callable[..., Any] = getattr(getattr(torch.ops, ops_namespace(self.tier)), name)
        return fn


def kernels_disabled() -> bool:
    return os.environ.get(ENV_DISABLE) == "1"


def load_extension(ext: NativeExtension, tier: CpuIsa | None = None
                   ) -> LoadedExtension | None:
    """`ext` at `tier` (default: the process's, choose_tier()), or the next lower tier that
    builds; None (torch's kernels) with $RADIXSERVE_NO_CPU_KERNELS=1 or where no tier builds.
    Raises CpuIsaError where $RADIXSERVE_CPU_ISA is invalid or above the CPU."""
    if kernels_disabled():
        return None
    return _load(ext, choose_tier().tier if tier is None else tier)


@functools.cache
def _load(ext: NativeExtension, tier: CpuIsa) -> LoadedExtension | None:
    """Once per process and (extension, tier): at most one warning."""
    failed: list[tuple[CpuIsa, BuildOutcome]] = []
    for candidate in sorted((t for t in CpuIsa if t.rank <= tier.rank), key=lambda t: -t.rank):
        outcome = build_extension(ext, candidate)
        if outcome.ok:
            if failed:
                _warn(ext, failed, f"running its {candidate.value} build")
            return LoadedExtension(ext, candidate)
        failed.append((candidate, outcome))
        # the same first error at two tiers: the toolchain, not a tier's code; stop paying
        if len(failed) >= 2 and failed[-1][1].error == failed[-2][1].error:
            break
    _warn(ext, failed, "using torch's kernels")
    return None


def _warn(ext: NativeExtension, failed: list[tuple[CpuIsa, BuildOutcome]], then: str) -> None:
    tier, first = failed[0]
    before = "failed before on this machine" if first.before else "failed"
    markers = " ".join(str(o.marker) for _, o in failed if o.marker is not None)
    logger.warning("%s unavailable at %s: the build %s (%s); %s. Later starts skip the failed "
                   "build; to retry: delete %s or set %s=1", ext.what, tier.value, before,
                   first.error, then, markers, ENV_RETRY)


def kernel_tier_line(choice: TierChoice | None = None) -> str:
    """What runs, for the start-up log and /server_info: `avx2 (no AVX-512 on this CPU)`,
    `torch (RADIXSERVE_NO_CPU_KERNELS=1)`, or the attention build's fallback tier."""
    if kernels_disabled():
        return f"torch ({ENV_DISABLE}=1)"
    choice = choose_tier() if choice is None else choice
    loaded = load_extension(ATTENTION, choice.tier)
    if loaded is None:
        return "torch (the native build failed)"
    if loaded.tier != choice.tier:
        return f"{loaded.tier.value} (the {choice.tier.value} build failed)"
    return choice.describe()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixserve.platform.kernels",
                                     description="The native CPU kernels' tiers.")
    parser.add_argument("--check-builds", action="store_true",
                        help="compile every extension for every tier (compile-only) and "
                             "print the table; exit 1 if any fails")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    if not args.check_builds:
        print(f"CPU kernels: {choose_tier().describe()}")
        return 0
    from radixserve.platform.check_builds import check_builds, format_table

    results = check_builds(EXTENSIONS, jobs=args.jobs, prelude=PRELUDE)
    print(format_table(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
