"""Native CPU attention kernels: building and loading them, and their torch reference.

Owns: compiling csrc/paged_decode.cpp with torch's C++ extension loader (once per source
version and machine, cached under ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR; a
first build takes ~1 min here), the resulting op `torch.ops.radixserve.paged_decode`, and
`paged_decode_reference`, the same computation in plain torch (the kernel's specification,
and what tests compare it with). Does not know: metadata, plans, the cascade (the torch
backend decides when the kernel applies).

If the build fails (no compiler, no ninja, an unusual platform), `load_paged_decode` returns
None and the caller keeps its torch path.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
# The extension's name carries the source's version (a changed kernel gets a fresh build; torch
# also rebuilds on a source hash change) and the CPU's flags: the build is -march=native, so
# a cache directory shared with another kind of CPU must not hand it a binary it cannot run.
EXT_BASE = "radixserve_paged_decode_v2"
# -ffast-math lets gcc vectorize the softmax's exp (glibc's libmvec). It is passed to the
# compile step only: a link with it would add crtfastmath (flush-to-zero for the whole process).
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd"]
ENV_DISABLE = "RADIXSERVE_NO_CPU_KERNELS"  # "1": skip the native kernels (the torch path)

PagedDecode = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` wheel's binary is in the venv, which a
    `.venv/bin/python ...` run does not put on PATH."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = str(ninja.BIN_DIR)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def cpu_tag() -> str:
    """A short digest of this CPU's feature flags (/proc/cpuinfo; the machine type elsewhere)."""
    flags = platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _registered() -> bool:
    return hasattr(torch.ops.radixserve, "paged_decode")


def load_paged_decode() -> PagedDecode | None:
    """torch.ops.radixserve.paged_decode, built on first use; None where unavailable."""
    if os.environ.get(ENV_DISABLE) == "1":
        return None
    if not _registered():
        try:
            from torch.utils.cpp_extension import load

            ninja_on_path()
            load(name=f"{EXT_BASE}_{cpu_tag()}", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                 is_python_module=False, verbose=False)
        except Exception as e:  # noqa: BLE001  any build failure: keep the torch path
            logger.warning("CPU paged decode kernel unavailable (%s: %s); using torch",
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return None
    op: PagedDecode = torch.ops.radixserve.paged_decode
    return op


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in float64, request by request.

    q (B, Hq, D); k_cache, v_cache (S, Hkv, D); slot_table (R, Lmax) int32; rows, starts,
    seq_lens (B,). Request b's query attends to slots slot_table[rows[b], starts[b]:seq_lens[b]].
    Returns out (B, Hq, D) in q's dtype and lse (B, Hq) float32.
    """
    B, Hq, D = q.shape
    G = Hq // k_cache.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    for b in range(B):
        slots = slot_table[int(rows[b]), int(starts[b]):int(seq_lens[b])].long()
        keys = k_cache[slots].double().repeat_interleave(G, dim=1)  # (L, Hq, D)
        values = v_cache[slots].double().repeat_interleave(G, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].double(), keys) * scale  # (Hq, L)
        lse[b] = torch.logsumexp(scores, dim=-1).float()
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", probs, values).to(q.dtype)
    return out, lse
