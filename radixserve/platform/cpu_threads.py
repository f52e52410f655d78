"""How many CPU threads the engine's torch runs with, from the cores this process is given.

Owns: reading the usable cores (the affinity mask, which taskset and cgroup cpusets set,
not the machine's core count) and the default thread count. Does not
know: torch (the model runner applies the number), the server.

The default leaves one core to the API process (HTTP, tokenizer, detokenizer, SSE) and
uses all the others, however many (see default_num_threads).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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
    """Threads for the engine when --num-threads is not given: every usable core but one.

    No upper cap: prefill is matmul-bound and scales with cores (decode, bound by reading
    the weights, gains less). The spare core keeps the API process (HTTP, tokenizer,
    detokenizer, SSE) and anything else on the box from preempting an OpenMP thread in the
    middle of a parallel region, where every other thread then waits for it. On a 2-core
    machine whose other core is busy that wait dominates, so 2 cores get 1 thread. On a
    quiet 2-core machine `--num-threads 2` is faster, but swings with the API process's
    wake-ups (figures: bench/README.md, "Threads" and "Figures moved from code comments").
    """
    n = usable_cores() if cores is None else cores
    if n == 1:
        return ThreadChoice(1, 1, "1 usable core")
    return ThreadChoice(n - 1, n, f"{n} usable cores, one left to the API process")


def choose_num_threads(configured: int | None, num_ranks: int = 1) -> ThreadChoice:
    """`num_ranks`: tensor-parallel ranks sharing this machine's cores; without
    --num-threads each gets an equal share of the default (at least one thread)."""
    if configured:
        n = usable_cores()
        return ThreadChoice(configured, n, f"set by --num-threads; {n} usable cores")
    choice = default_num_threads()
    if num_ranks == 1:
        return choice
    share = max(choice.num_threads // num_ranks, 1)
    return ThreadChoice(share, choice.usable_cores,
                        f"{choice.reason}, shared by {num_ranks} tensor-parallel ranks")
