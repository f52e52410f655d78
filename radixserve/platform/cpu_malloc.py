"""glibc malloc settings for the engine process on CPU: freed activations stay in the heap.

Owns: one call, `keep_freed_memory`, made once by the model runner before it loads weights.
Does not know: torch, threads, the model.

Why: a forward allocates a fresh tensor for nearly every op, several MB each in a prefill
chunk (a 2048-token chunk's gate/up output is 12.6 MB in fp32). glibc serves blocks above its
mmap threshold (128 KB, raised dynamically only up to 32 MB) with a fresh mmap and unmaps them
on free, and trims freed memory at the top of the heap: either way the next forward's tensors
arrive as untouched pages and every 4 KB page faults (and is zeroed by the kernel) on first
write, which costs more than the op itself on a small model (figures: bench/README.md,
"Figures moved from code comments"). With mmap off
(M_MMAP_MAX = 0) and a trim threshold of 2 GB, the heap keeps its high-water mark: the
engine's resident memory stays at its peak activation size instead of shrinking between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's malloc.h parameter numbers
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the largest, ~2 GB
ENV_DISABLE = "RADIXSERVE_DEFAULT_MALLOC"  # "1": leave glibc's defaults alone


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to serve every block from the heap and keep what is freed; False
    (and nothing changed) off glibc, or when RADIXSERVE_DEFAULT_MALLOC=1."""
    if os.environ.get(ENV_DISABLE) == "1" or platform.system() != "Linux":
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success
    return bool(mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
