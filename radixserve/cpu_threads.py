"""How many CPU threads the engine's torch runs with, from the cores this process is given.

Owns: reading the usable cores (the affinity mask, which taskset, cgroups cpusets and
container limits set, not the machine's core count) and the default thread count. Does not
know: torch (the model runner applies the number), the server.

The default leaves one core to the API process (HTTP, tokenizer, detokenizer, SSE) when there
are enough cores that the engine loses little by it; on small machines it is a measured choice
(see default_num_threads).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# From this many usable cores on, one is left to the API process: the engine loses at most
# 1/4 of its matmul throughput, and in exchange tokenizing and streaming never preempt an
# OpenMP thread in the middle of a parallel region (where every other thread then waits).
SPARE_ONE_FROM = 4
# Below SPARE_ONE_FROM, the default uses every usable core: measured on 2 shared cores
# (bench/README.md, "Threads"), 2 threads beat 1 on the prefill-bound workloads even with
# the second core busy, and the API process costs the engine little (its CPU time is ~1% of
# a run's).
SMALL_MACHINE_THREADS_ALL = True


@dataclass(frozen=True)
class ThreadChoice:
    num_threads: int
    usable_cores: int
    reason: str  # for the start-up log


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask where the OS has one."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_num_threads(cores: int | None = None) -> ThreadChoice:
    """Threads for the engine when --num-threads is not given."""
    n = usable_cores() if cores is None else cores
    if n >= SPARE_ONE_FROM:
        return ThreadChoice(n - 1, n, f"{n} usable cores, one left to the API process")
    if SMALL_MACHINE_THREADS_ALL or n == 1:
        return ThreadChoice(n, n, f"{n} usable core(s), all used (too few to spare one)")
    return ThreadChoice(n - 1, n, f"{n} usable cores, one left to the API process")


def choose_num_threads(configured: int | None) -> ThreadChoice:
    if configured:
        n = usable_cores()
        return ThreadChoice(configured, n, f"--num-threads {configured} ({n} usable cores)")
    return default_num_threads()
