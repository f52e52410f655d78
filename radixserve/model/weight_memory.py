"""The loaded model's weights in 2 MB pages (CPU): which memory they occupy, and advising it.

Owns: `weight_ranges` (the address ranges of a model's large CPU tensors, found by walking its
objects: plain weights, oneDNN's prepacked ones, embeddings, experts, quantized codes) and
`place_weights` (platform/huge_pages.py's advice over them, with what the kernel gave, for the
start-up log and /server_info). Does not know: layers' classes (any radixserve object's
attributes are walked), the OS (huge_pages.py).

Called once after the model is built and before the first forward: prepacking has made its
fresh allocations by then, and nothing has read a weight yet. Opt out with
RADIXSERVE_WEIGHT_HUGE_PAGES=0 (the decode-floor bench's before/after). Weights a native op
keeps inside its own C++ object are not seen (none of the float paths do).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.platform.huge_pages import HugePageAdvice, Range, advise_huge, huge_bytes

ENV_HUGE_PAGES = "RADIXSERVE_WEIGHT_HUGE_PAGES"  # "0": leave the weights' pages as they are
MIN_BYTES = 256 * 1024  # smaller tensors (norms, biases) ride along in their neighbours' pages


def tensor_range(t: torch.Tensor) -> Range | None:
    """(address, bytes) a CPU tensor reads; None on another device or for a sparse layout."""
    if t.device.type != "cpu":
        return None
    if t.is_mkldnn:  # oneDNN's prepacked (opaque) weight: no strides, its own buffer
        try:
            return int(torch.ops.mkldnn.data_ptr(t)), int(torch.ops.mkldnn._nbytes(t))
        except (AttributeError, RuntimeError):  # a torch build without these ops
            return None
    if t.layout != torch.strided or t.numel() == 0:
        return None
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), extent * t.element_size()


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    if not type(obj).__module__.startswith("radixserve."):
        return []  # torch ops, functions, configs of other libraries: no weights of ours
    attrs = list(getattr(obj, "__dict__", {}).values())
    for cls in type(obj).__mro__:
        attrs += [getattr(obj, s) for s in getattr(cls, "__slots__", ()) if hasattr(obj, s)]
    return attrs


def weight_ranges(root: Any, min_bytes: int = MIN_BYTES) -> list[Range]:
    """The ranges of every CPU tensor of at least `min_bytes` reachable from `root` through
    radixserve objects' attributes, lists, tuples and dicts (each tensor once)."""
    seen: set[int] = set()
    ranges: list[Range] = []
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            r = tensor_range(obj)
            if r is not None and r[1] >= min_bytes:
                ranges.append(r)
        else:
            stack += _children(obj)
    return ranges


@dataclass(frozen=True)
class WeightPages:
    """What the weights got: `weight_bytes` in the large tensors, `huge` of their 2 MB spans
    backed by huge pages (AnonHugePages), and the advice's outcome."""

    weight_bytes: int
    huge: int
    advice: HugePageAdvice

    def describe(self) -> str:
        a = self.advice
        if a.mode not in ("always", "madvise"):
            return f"4 KB pages (transparent huge pages: {a.mode or 'unavailable'})"
        how = "collapsed" if a.collapsed else f"advised, not collapsed: {a.error}"
        return (f"{self.huge / 1e6:.0f} MB in 2 MB pages of {self.weight_bytes / 1e6:.0f} MB "
                f"(THP {a.mode}; {how})")

    def info(self) -> dict[str, Any]:
        """For /server_info."""
        return {"thp": self.advice.mode, "weight_bytes": self.weight_bytes,
                "advised_bytes": self.advice.advised, "anon_huge_bytes": self.huge,
                "collapsed": self.advice.collapsed, "error": self.advice.error}


def place_weights(model: Any, mode: str | None = None) -> WeightPages | None:
    """Advise the model's large CPU tensors into huge pages; None when opted out (or nothing
    is on the CPU). `mode` overrides the kernel's THP mode (tests)."""
    if os.environ.get(ENV_HUGE_PAGES, "").strip() == "0":
        return None
    ranges = weight_ranges(model)
    if not ranges:
        return None
    advice = advise_huge(ranges, mode)
    huge = huge_bytes(ranges) if advice.advised else 0
    return WeightPages(sum(n for _, n in ranges), huge, advice)
