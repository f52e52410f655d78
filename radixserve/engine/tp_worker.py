"""A tensor-parallel worker process (ranks 1 .. N - 1): its shard of the model, one step at a time.

Owns: the worker's loop: wait for rank 0's header, unpack the step (tp_step.py), write its
own slot table and run the same forward on its shard, taking part in its collectives; and
the worker's exit: on STOP, when a collective fails (rank 0 died or the group broke), or
when its parent (rank 0's engine process, or the node's launcher) is gone.
Does not know: requests, the scheduler, sampling (rank 0 samples), HTTP.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from radixserve.config import EngineConfig
from radixserve.engine.model_runner import ModelRunner
from radixserve.engine.step_inputs import write_slot_table
from radixserve.engine.tp_ranks import TPRank
from radixserve.engine.tp_step import unpack_step
from radixserve.parallel.comm import StepKind

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0


def _exit_when_orphaned(parent_pid: int) -> None:
    """A worker whose parent is gone (SIGKILLed) must not outlive it."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def serve_steps(runner: ModelRunner) -> None:
    """Run rank 0's steps on this rank's shard until STOP."""
    comm, pool = runner.tp, runner.pool
    assert comm is not None
    num_steps = 0
    while True:
        kind, payload = comm.recv()
        if kind is StepKind.STOP:
            logger.info("stopping after %d steps", num_steps)
            return
        if kind is StepKind.PING or payload is None:
            continue
        inputs = unpack_step(payload, pool.slot_table)
        write_slot_table(pool.slot_table, inputs.meta, inputs.positions, inputs.table_back)
        runner.forward_eager(inputs)
        num_steps += 1


def run_tp_worker(cfg: EngineConfig, tp_rank: TPRank, parent_pid: int) -> None:
    """Process entry point (tp_ranks.py spawns it by name)."""
    # Ctrl-C reaches the whole process group; rank 0 owns the shutdown (STOP).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s tp{tp_rank.rank}: %(message)s")
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    try:
        runner = ModelRunner(cfg, show_progress=False, tp_rank=tp_rank)
        serve_steps(runner)
    except Exception:  # noqa: BLE001 - a broken group or a failed load: exit non-zero
        logger.exception("tensor-parallel rank %d failed", tp_rank.rank)
        raise SystemExit(1) from None
    assert runner.tp is not None
    runner.tp.close()  # only after STOP: leaving a broken group could wait on dead peers
