"""Host time of the fused-kernel wrappers per call, with their argument checks and without.

Owns: timing `rope_qk_store`, `fused_add_rmsnorm`, `rms_norm` and `silu_mul` at a decode shape
(8 tokens, the Llama-1B layer: hidden 2048, 32/8 heads of 64, intermediate 8192) with the
kernel launch (and its device test) replaced by a no-op, so what is timed is the wrapper's own Python: argument
checks (`check=True`, what model/layers/ runs on layer 0) or none (`check=False`,
its other layers), grid and block sizes. Does not know: the kernels' device time, or Triton's
launch cost (timed on a GPU by bench.fused_kernels).

    python -m bench.wrapper_host_cost [--calls 20000] [--repeats 5]

Runs on CPU under Triton's interpreter (the launches never run, so no kernel executes).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from types import ModuleType

from bench.common.interpret import turn_on_interpreter

T, HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, INTER = 8, 2048, 32, 8, 64, 8192
KERNELS = {"fused_add_rmsnorm": "_rmsnorm_kernel", "rope": "_rope_kernel",
           "silu_mul": "_silu_mul_kernel"}


class _NoLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def _launchable_anywhere(kernel: object, device: object) -> None:
    """Stands in for triton_kernels._common.check_launchable: every device passes."""


def _modules() -> dict[str, ModuleType]:
    mods = {name: importlib.import_module(f"triton_kernels.{name}") for name in KERNELS}
    for name, kernel in KERNELS.items():  # this process only; it exits afterwards
        setattr(mods[name], kernel, _NoLaunch())
        # The device test asks whether the kernel is interpreted, which a stand-in is not; on
        # CUDA it is one string compare. The module's own global (bound by its `from
        # triton_kernels._common import`) is what its wrappers call, so that is the one replaced.
        vars(mods[name])["check_launchable"] = _launchable_anywhere
    return mods


def _calls(mods: dict[str, ModuleType], check: bool) -> dict[str, Callable[[], object]]:
    import torch

    x, res, w = torch.randn(T, HIDDEN), torch.randn(T, HIDDEN), torch.randn(HIDDEN)
    qkv = torch.randn(T, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)
    cos, sin = torch.randn(4096, HEAD_DIM), torch.randn(4096, HEAD_DIM)
    pos = slots = torch.arange(T)
    kc, vc = torch.zeros(64, KV_HEADS, HEAD_DIM), torch.zeros(64, KV_HEADS, HEAD_DIM)
    gate_up, out = torch.randn(T, 2 * INTER), torch.empty(T, INTER)
    norm, rope, silu = mods["fused_add_rmsnorm"], mods["rope"], mods["silu_mul"]
    return {
        "rope_qk_store": lambda: rope.rope_qk_store(qkv, cos, sin, pos, Q_HEADS, kc, vc, slots,
                                                    check=check),
        "fused_add_rmsnorm": lambda: norm.fused_add_rmsnorm(x, res, w, 1e-5, check=check),
        "rms_norm": lambda: norm.rms_norm(x, w, 1e-5, out=res, check=check),
        "silu_mul": lambda: silu.silu_mul(gate_up, out, check=check),
    }


def us_per_call(fn: Callable[[], object], calls: int, repeats: int) -> float:
    per = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(per)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wrapper_host_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if not turn_on_interpreter():
        return 2
    mods = _modules()
    checked, unchecked = _calls(mods, True), _calls(mods, False)
    print(f"{'us per call':18s} {'checked':>8s} {'unchecked':>9s}")
    layer = [0.0, 0.0]
    for name in checked:
        a = us_per_call(checked[name], args.calls, args.repeats)
        b = us_per_call(unchecked[name], args.calls, args.repeats)
        weight = {"rope_qk_store": 1, "fused_add_rmsnorm": 2, "silu_mul": 1}.get(name, 0)
        layer = [layer[0] + weight * a, layer[1] + weight * b]
        print(f"{name:18s} {a:8.2f} {b:9.2f}")
    print(f"{'decoder_layer':18s} {layer[0]:8.2f} {layer[1]:9.2f}  (rope + 2 norms + silu)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
