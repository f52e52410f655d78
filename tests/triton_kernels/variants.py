"""Counting the variants Triton compiles for a kernel's launches, on a machine without a GPU.

Owns: `VariantRecorder`, a stand-in for a @triton.jit kernel that computes each launch's
specialization key with Triton's own binder for an sm_90 target (the constexprs, and the
runtime arguments' specializations: an int equal to 1 or a multiple of 16, a pointer's
16-byte alignment, except where the kernel says do_not_specialize), then launches the kernel
itself (compiled on CUDA, interpreted on CPU). The distinct keys are the compiles an eager
server makes: JITFunction.run looks its kernel cache up by the same key. Does not know: what
any kernel computes.
"""

from __future__ import annotations

from typing import Any

from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

SM90 = GPUTarget("cuda", 90, 32)


class VariantRecorder:
    """kernel[grid](*args, **kwargs), recording the launch's specialization key in `keys`."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        jit = kernel
        if not isinstance(kernel, JITFunction):  # the interpreter's stand-in: same arguments
            jit = JITFunction(kernel.fn, **{k: kernel.kwargs.get(k) for k in (
                "do_not_specialize", "do_not_specialize_on_alignment")})
        self._bind = create_function_from_signature(jit.signature, jit.params,
                                                    make_backend(SM90))
        self.keys: set[str] = set()

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            _, specialization, options = self._bind(*args, **kwargs)
            self.keys.add(str(specialization) + str(sorted(options.items())))
            return self.kernel[grid](*args, **kwargs)
        return launch
