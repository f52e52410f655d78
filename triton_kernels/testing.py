"""Helpers for running the kernels where there is no GPU (tests, CPU-only CI).

Owns: choosing the device kernel tests run on, and checking that Triton's CPU interpreter is
really on. Does not know: any kernel's algorithm.

NOTE: TRITON_INTERPRET is read when a function is decorated with @triton.jit, and triton
decorates its own helpers (tl.cdiv, tl.max, tl.sum, ...) when `triton` is first imported. So
it must be set before anything imports triton (transformers does, on import), e.g. at the top
of tests/conftest.py; setting it later leaves those helpers compiled-only, and every kernel
fails inside the interpreter.
"""

from __future__ import annotations

import os

import torch
import triton.language as tl

from triton_kernels._common import is_interpreted
from triton_kernels.decode_attention import _decode_merge_kernel, _decode_split_kernel
from triton_kernels.extend_attention import _extend_kernel
from triton_kernels.fused_add_rmsnorm import _rmsnorm_kernel
from triton_kernels.rope import _rope_kernel
from triton_kernels.silu_mul import _silu_mul_kernel
from triton_kernels.store_kv import _store_kv_kernel

KERNELS = (_store_kv_kernel, _decode_split_kernel, _decode_merge_kernel, _extend_kernel,
           _rmsnorm_kernel, _rope_kernel, _silu_mul_kernel)


class InterpreterOffError(RuntimeError):
    """No CUDA device, and Triton's interpreter was not on when triton was imported."""


def interpreter_active() -> bool:
    """Whether triton's own helpers and all our kernels were decorated for the interpreter."""
    return is_interpreted(tl.cdiv) and all(is_interpreted(k) for k in KERNELS)


def default_device() -> torch.device:
    """CUDA when present; else CPU, provided the interpreter is on (raises otherwise)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not interpreter_active():
        raise InterpreterOffError(
            "no CUDA device and Triton's interpreter is off "
            f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} now): set "
            "TRITON_INTERPRET=1 before triton is first imported, e.g. at the top of "
            "tests/conftest.py, before transformers (which imports triton)"
        )
    return torch.device("cpu")


def device_or_error() -> tuple[torch.device, str]:
    """(default_device(), "") or (cpu, why the kernels cannot run): a test module calls it at
    import and fails its kernel tests with the message, rather than the whole collection."""
    try:
        return default_device(), ""
    except InterpreterOffError as e:
        return torch.device("cpu"), str(e)
