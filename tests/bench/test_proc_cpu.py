"""bench.common.proc_cpu: CPU seconds of a process group, from a fake /proc and from a real child."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common.proc_cpu import _TICKS, group_cpu_seconds


def _stat(pid: int, comm: str, pgrp: int, utime: int, stime: int) -> str:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    return f"{pid} ({comm}) S 1 {pgrp} {pgrp} 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0\n"


def test_sums_the_group_from_proc_files(tmp_path: Path) -> None:
    for pid, comm, pgrp, ut, st in [(10, "python", 10, 100, 20), (11, "odd) name (x", 10, 7, 3),
                                    (12, "other", 99, 500, 500)]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(_stat(pid, comm, pgrp, ut, st))
    (tmp_path / "self").mkdir()  # not a pid: skipped
    (tmp_path / "13").mkdir()  # exited between listing and reading: skipped
    assert group_cpu_seconds(10, tmp_path) == (100 + 20 + 7 + 3) / _TICKS
    assert group_cpu_seconds(42, tmp_path) == 0.0
    assert group_cpu_seconds(10, tmp_path / "missing") is None


def test_counts_a_busy_child_in_its_own_session() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys\nwhile True: pass"],
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        cpu = group_cpu_seconds(child.pid)
        while (cpu or 0.0) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
            cpu = group_cpu_seconds(child.pid)
        assert cpu is not None and cpu >= 0.3
        assert group_cpu_seconds(os.getpgrp()) != cpu  # another group, counted apart
    finally:
        child.kill()
        child.wait()
