"""Native CPU attention kernels: building and loading them, and their torch references.

Owns: compiling csrc/paged_decode*.cpp and csrc/prefill_attention*.cpp into one extension with
torch's C++ extension loader (once per source version and machine, cached under
~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR; a first build is logged with its
duration), the resulting ops `torch.ops.radixserve.paged_decode` and
`torch.ops.radixserve.prefill_attention`, and `paged_decode_reference` /
`prefill_attention_reference`, the same computations in plain torch (the kernels'
specifications, and what tests compare them with). Does not know:
metadata, plans, the cascade (the torch backend and varlen.py decide when a kernel applies).

If the build fails (no compiler, no ninja, an unusual platform), the loaders return None and
the caller keeps its torch path.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("paged_decode.cpp", "paged_decode_fp8.cpp", "paged_decode_fp8_amx.cpp",
                        "paged_decode_fp8_bf16.cpp", "prefill_attention.cpp",
                        "prefill_attention_bf16.cpp")]
# The extension's name carries the source's version (a changed kernel gets a fresh build; torch
# also rebuilds on a source hash change) and the CPU's flags: the build is -march=native, so
# a cache directory shared with another kind of CPU must not hand it a binary it cannot run.
EXT_BASE = "radixserve_cpu_attention_v21"
# -ffast-math lets gcc vectorize the softmax's exp (glibc's libmvec). It is passed to the
# compile step only: a link with it would add crtfastmath (flush-to-zero for the whole process).
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
# -fopenmp on both steps: at::parallel_for is a header template whose `omp parallel` compiles
# away without it (the kernels then ran on one thread whatever torch's setting). The link
# needs libgomp.so.1, which resolves to the copy torch already loaded (the same soname): one
# OpenMP runtime, one thread pool, sized by torch.set_num_threads.
LDFLAGS = ["-fopenmp"]
# Loading a cached build takes well under this; longer means torch recompiled it.
REBUILD_NOTICE_S = 5.0
ENV_DISABLE = "RADIXSERVE_NO_CPU_KERNELS"  # "1": skip the native kernels (the torch path)
# "1": build even where an earlier build with the same sources, flags and compiler failed
ENV_RETRY = "RADIXSERVE_RETRY_CPU_BUILD"
# "1": the 8-bit decode kernel keeps its AVX512-BF16 path on an AMX CPU (read once per process by
# csrc/paged_decode_fp8_amx.cpp; to compare or test the two paths)
ENV_NO_AMX = "RADIXSERVE_NO_AMX"

# prefill_attention's head dims (template instances in the kernel); others keep the torch path
PREFILL_HEAD_DIMS = (32, 64, 128)

PagedDecode = Callable[..., tuple[torch.Tensor, torch.Tensor]]
PrefillAttention = Callable[..., tuple[torch.Tensor, torch.Tensor]]


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
    return hasattr(torch.ops.radixserve, "paged_decode") and hasattr(
        torch.ops.radixserve, "prefill_attention")


def cached_build(full_name: str) -> Path | None:
    """The built library of extension `full_name` if torch's build folder already holds it
    (then `load` only loads it), else None (the next `load` compiles it: seconds to minutes)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory(full_name, verbose=False))
    except Exception:  # noqa: BLE001  a torch without the helper: report "not cached"
        return None
    library = folder / f"{full_name}.so"
    return library if library.is_file() else None


def _compiler() -> Path | None:
    """The C++ compiler torch's loader runs ($CXX, else c++), resolved; None if not found."""
    found = shutil.which(os.environ.get("CXX") or "c++")
    return Path(found).resolve() if found else None


def build_key(full_name: str, sources: Sequence[Path], cflags: Sequence[str]) -> str:
    """What a build's outcome depends on: the sources and every header beside them, the flags
    and the compiler (its path, size and mtime: not `--version`, whose run a broken compiler
    could make as slow as the build)."""
    digest = hashlib.sha256(full_name.encode())
    folders = sorted({s.parent for s in sources})
    for path in [*sources, *sorted(h for d in folders for h in d.glob("*.h"))]:
        digest.update(path.name.encode())
        with contextlib.suppress(OSError):  # a missing source: the build reports it
            digest.update(path.read_bytes())
    digest.update(" ".join([*cflags, *LDFLAGS]).encode())
    cxx = _compiler()
    if cxx is not None:
        st = cxx.stat()
        digest.update(f"{cxx}:{st.st_size}:{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def failure_marker(full_name: str, key: str) -> Path:
    """Where a failed build of `full_name` with `key` is remembered across processes."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
        Path.home() / ".cache" / "torch_extensions")
    return Path(root) / "radixserve-failed-builds" / f"{full_name}-{key}.txt"


def first_error_line(message: str) -> str:
    """The compiler's first `error:` line in a failed build's output, else its first line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if "error:" in line or "Error:" in line:
            return line[:300]
    return lines[0][:300] if lines else "no output"


def _remember_failure(marker: Path, first_error: str) -> None:
    """Write the marker atomically (another process may be reading it)."""
    with contextlib.suppress(OSError):
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(first_error + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, marker)


@functools.cache
def build_extension(name: str, sources: tuple[Path, ...], what: str,
                    cflags: tuple[str, ...] = tuple(CFLAGS)) -> bool:
    """Build (or load the cached build of) a C++ extension registering torch ops; False, with
    one warning naming `what`, when that fails (the caller keeps its torch path).

    The outcome is remembered in the process (functools.cache) and a failure also on disk
    (failure_marker: per sources, headers, flags and compiler), so a broken toolchain costs
    one compile per machine, not one per start. $RADIXSERVE_RETRY_CPU_BUILD=1 ignores the
    marker. A build (the first start on a machine, or after a kernel changed) is logged before
    and after, with its duration: it runs while the weights load and would otherwise look like
    a hang."""
    full_name = f"{name}_{cpu_tag()}"
    marker = failure_marker(full_name, build_key(full_name, sources, cflags))
    if marker.is_file() and os.environ.get(ENV_RETRY) != "1":
        logger.warning("%s unavailable: their build failed before on this machine (%s); using "
                       "torch's kernels. To retry: delete %s or set %s=1", what,
                       marker.read_text().strip(), marker, ENV_RETRY)
        return False
    building = cached_build(full_name) is None
    if building:
        logger.info("building the native %s (first start on this machine only; cached under "
                    "$TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions)", what)
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        ninja_on_path()
        load(name=full_name, sources=[str(s) for s in sources],
             extra_cflags=list(cflags), extra_ldflags=LDFLAGS, is_python_module=False,
             verbose=False)
    except Exception as e:  # noqa: BLE001  any build failure: keep the torch path
        first = f"{type(e).__name__}: {first_error_line(str(e))}"
        _remember_failure(marker, first)
        logger.warning("%s unavailable (%s); using torch's kernels. Later starts skip the "
                       "build; to retry: delete %s or set %s=1", what, first, marker, ENV_RETRY)
        return False
    elapsed = time.perf_counter() - start
    if building:
        logger.info("built the native %s in %.1f s; later starts load the cached build",
                    what, elapsed)
    elif elapsed > REBUILD_NOTICE_S:  # a cached build whose sources or flags changed
        logger.info("rebuilt the native %s in %.1f s (their sources or flags changed)", what,
                    elapsed)
    return True


def _build() -> bool:
    """Build (or load the cached build of) the extension once per process; False on failure."""
    if os.environ.get(ENV_DISABLE) == "1":
        return False
    return _registered() or build_extension(EXT_BASE, tuple(SOURCES), "CPU attention kernels")


def load_paged_decode() -> PagedDecode | None:
    """torch.ops.radixserve.paged_decode, built on first use; None where unavailable."""
    if not _build():
        return None
    op: PagedDecode = torch.ops.radixserve.paged_decode
    return op


def load_prefill_attention() -> PrefillAttention | None:
    """torch.ops.radixserve.prefill_attention, built on first use; None where unavailable."""
    if not _build():
        return None
    op: PrefillAttention = torch.ops.radixserve.prefill_attention
    return op


def cap_scores(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Logit soft-capping (Gemma 2): softcap * tanh(scores / softcap); None: as they are."""
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, softcap: float | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in float64, request by request.

    q (B, Hq, D); k_cache, v_cache (S, Hkv, D); slot_table (R, Lmax) int32; rows, starts,
    seq_lens (B,). Request b's query attends to slots slot_table[rows[b], starts[b]:seq_lens[b]]
    (a sliding window W is starts[b] raised to seq_lens[b] - W); softcap: the scaled scores
    soft-capped before the softmax (the kernel's `softcap=`; None there is 0).
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
        scores = cap_scores(torch.einsum("hd,lhd->hl", q[b].double(), keys) * scale,
                            softcap)  # (Hq, L)
        lse[b] = torch.logsumexp(scores, dim=-1).float()
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", probs, values).to(q.dtype)
    return out, lse


def prefill_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor,
                                prefix_slots: torch.Tensor, scale: float,
                                softcap: float | None = None, window: int | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """What prefill_attention computes, in float64.

    q (M, Hq, D), k/v (M, Hkv, D): one request's chunk; prefix_slots (P,) int32: its cached
    keys' slots in k_cache/v_cache (S, Hkv, D). Query i attends to the P prefix keys and to
    the chunk's keys 0..i; with a window W, only to keys P + i - W + 1 .. P + i of that index
    space (the prefix keys consecutive positions ending just before the chunk). softcap: the
    scaled scores soft-capped before the softmax. (The kernel takes `softcap=`, `window=`;
    0 there is None.) Returns out (M, Hq, D) in q's dtype and lse (M, Hq) float32.
    """
    M, Hq, _ = q.shape
    G = Hq // k.shape[1]
    slots = prefix_slots.long()
    keys = torch.cat([k_cache[slots], k]).double().repeat_interleave(G, dim=1)  # (P+M, Hq, D)
    values = torch.cat([v_cache[slots], v]).double().repeat_interleave(G, dim=1)
    P = slots.numel()
    scores = cap_scores(torch.einsum("mhd,lhd->hml", q.double(), keys) * scale,
                        softcap)  # (Hq, M, P+M)
    query = P + torch.arange(M, device=q.device)  # (M,) key index of each query
    key = torch.arange(P + M, device=q.device)  # (P+M,)
    hidden = key[None, :] > query[:, None]  # (M, P+M): causal
    if window is not None:
        hidden |= key[None, :] <= query[:, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (Hq, M)
    out = torch.einsum("hml,lhd->mhd", torch.softmax(scores, dim=-1), values)
    return out.to(q.dtype), lse.transpose(0, 1).float().contiguous()
