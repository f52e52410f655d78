"""bench.wrapper_host_cost runs (in its own process: it stubs the kernels' launches there) and
prints a time per call for each wrapper, checked and unchecked (no timing is asserted)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.repo import REPO_ROOT


def test_prints_checked_and_unchecked_host_time_per_wrapper() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-m", "bench.wrapper_host_cost", "--calls", "300",
                          "--repeats", "3"], env=env, cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines()[1:]}
    assert set(rows) == {"rope_qk_store", "fused_add_rmsnorm", "rms_norm", "silu_mul",
                         "decoder_layer"}
    assert all(float(v) > 0 for times in rows.values() for v in times), out
