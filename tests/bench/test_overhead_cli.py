"""bench.overhead's simulated device, run as issue 42 names it: `python -m bench.overhead
--simulated-device-ms T` (here with one small batch, few steps and one round, so it is cheap)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.repo import REPO_ROOT


def test_simulated_device_command_reports_both_modes() -> None:
    cmd = [sys.executable, "-m", "bench.overhead", "--simulated-device-ms", "5",
           "--batches", "1", "--steps", "3", "--rounds", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "simulated device: forward = a 5 ms wait" in done.stdout
    line = re.search(r"batch\s+1: host\s+([\d.]+); without overlap\s+([\d.]+) .*"
                     r"with overlap\s+([\d.]+)", done.stdout)
    assert line is not None, done.stdout
    host, off, on = (float(v) for v in line.groups())
    # a step that waits 5 ms on the device takes at least that long, with or without overlap
    assert host > 0 and off >= 5.0 and on >= 5.0
