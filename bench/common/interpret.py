"""Turning on Triton's CPU interpreter for a kernel benchmark's --interpret pass.

Owns: setting TRITON_INTERPRET=1 before triton is first imported, and saying so when it is
too late. Does not know: any kernel.
"""

from __future__ import annotations

import os
import sys


def turn_on_interpreter() -> bool:
    """True when the kernels will run on CPU tensors; False (reported on stderr) when triton
    was already imported without the interpreter."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        print("triton was imported before TRITON_INTERPRET could be set", file=sys.stderr)
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True
