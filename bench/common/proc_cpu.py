"""CPU time of a process group, from /proc: what a server under test really consumed.

Owns: summing utime + stime over the live processes of one process group (a server started
in its own session, with the engine processes it spawned). Does not know: servers, runs.
CPU time does not count the time other processes hold the cores, so on a shared, loaded
machine it is the steadier measure of the work a system did; a process that exits between
two readings takes its share with it. Linux only: elsewhere the readings are None.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def group_cpu_seconds(pgid: int, proc: Path = Path("/proc")) -> float | None:
    """utime + stime, in seconds, of every live process whose process group is `pgid`."""
    if not proc.is_dir():
        return None
    total = 0
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:  # gone since the listing
            continue
        # fields after "pid (comm)"; comm may hold spaces and parentheses
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # field 5 of stat: pgrp
            total += int(fields[11]) + int(fields[12])  # fields 14, 15: utime, stime
    return total / _TICKS
