"""The tensor-parallel ranks' processes: rank 0 starts, watches and stops its node's workers.

Owns: where a rank meets the others (TPRank: its global and local rank, the rendezvous),
starting the local worker processes (spawn; rank 0 is the engine process itself, or on
another node `serve --node-rank K` starts only that node's workers: run_node), the monitor
that turns a dead worker into TPFailedError's reason (and, in the engine process, into an
exit within seconds should the step loop stay stuck in a collective), the idle heartbeat
(a PING when no step ran for HEARTBEAT_S, so a worker's wait for the next step never reaches
the collective timeout) and the clean stop. Does not know: the model, steps' contents
(tp_worker.py runs a worker), the scheduler.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from radixserve.config import EngineConfig
from radixserve.parallel.comm import StepKind, TPComm

logger = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
# After a worker dies, the step loop gets this long to fail the requests itself (its
# collective errors out on the closed socket); then the engine process exits regardless.
FAIL_GRACE_S = 5.0
STOP_TIMEOUT_S = 10.0
WORKER_ENTRY = "radixserve.engine.tp_worker:run_tp_worker"


class TPFailedError(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot step again."""


@dataclass(frozen=True)
class TPRank:
    rank: int
    local_rank: int  # on its node: its GPU under NCCL
    init_method: str  # tcp://HOST:PORT of rank 0's rendezvous


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def lead_rank(cfg: EngineConfig) -> TPRank:
    """Rank 0: its rendezvous (--dist-init-addr, or a free loopback port on one node)."""
    addr = cfg.dist_init_addr or f"127.0.0.1:{_free_port()}"
    return TPRank(0, 0, f"tcp://{addr}")


def _node_ranks(cfg: EngineConfig) -> range:
    per_node = cfg.tensor_parallel_size // cfg.nnodes
    return range(cfg.node_rank * per_node, (cfg.node_rank + 1) * per_node)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _worker_main(entry: str, *args: Any) -> None:
    """The spawned worker's target: imports the worker side by name, there only."""
    module_name, _, attr = entry.partition(":")
    getattr(importlib.import_module(module_name), attr)(*args)


def _spawn(cfg: EngineConfig, ranks: range, init_method: str) -> dict[int, Any]:
    if not cfg.dist_init_addr and cfg.device != "cuda":
        # One node: the ranks meet on loopback (gloo otherwise resolves the host name).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    procs = {}
    per_node = cfg.tensor_parallel_size // cfg.nnodes
    for rank in ranks:
        p = ctx.Process(target=_worker_main, name=f"radixserve-tp{rank}", daemon=True,
                        args=(WORKER_ENTRY, cfg, TPRank(rank, rank % per_node, init_method),
                              os.getpid()))
        p.start()
        procs[rank] = p
    return procs


class TPWorkers:
    """Rank 0's view of its node's worker processes (ranks 1 .. per node - 1)."""

    def __init__(self, cfg: EngineConfig, lead: TPRank) -> None:
        ranks = range(1, cfg.tensor_parallel_size // cfg.nnodes)
        self.procs = _spawn(cfg, ranks, lead.init_method)
        self.failure: str | None = None  # why the group is broken, once it is
        self._closing = threading.Event()
        self._comm: TPComm | None = None
        self._exit_on_failure = mp.parent_process() is not None  # the engine's own process
        threading.Thread(target=self._watch, name="tp-monitor", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def start_heartbeat(self, comm: TPComm) -> None:
        """Once every rank finished its set-up (whose collectives a PING would cross)."""
        self._comm = comm
        threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: (rank, p) for rank, p in self.procs.items()}
        if not by_sentinel:
            return
        ready = mp.connection.wait(list(by_sentinel))
        if self._closing.is_set():
            return
        rank, proc = by_sentinel[ready[0]]
        proc.join(1.0)
        self.failure = (f"tensor-parallel rank {rank} (pid {proc.pid}) "
                        f"{describe_exit(proc.exitcode)}")
        logger.error("%s", self.failure)
        if self._closing.wait(FAIL_GRACE_S) or not self._exit_on_failure:
            return
        logger.error("the step loop did not stop on its own: exiting the engine process")
        self.terminate()
        os._exit(1)

    def _heartbeat(self) -> None:
        while not self._closing.wait(HEARTBEAT_S / 2):
            if self.failure is not None or self._comm is None:
                return
            try:
                self._comm.ping_if_idle(HEARTBEAT_S)
            except RuntimeError as err:  # a rank on another node died: no sentinel tells
                time.sleep(1.0)  # a local worker's death is the monitor's to name
                if self.failure is None:
                    self.failure = f"the tensor-parallel group broke while idle: {err}"
                    logger.error("%s", self.failure)
                return

    def check(self) -> None:
        if self.failure is not None:
            raise TPFailedError(self.failure)

    def error_for(self, err: BaseException) -> TPFailedError:
        """The error a failed collective becomes: which rank died, when the monitor knows."""
        deadline = time.monotonic() + 1.0
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)  # a dead peer's socket often closes before its exit is seen
        return TPFailedError(self.failure or f"a tensor-parallel collective failed: {err}")

    def terminate(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        for p in self.procs.values():
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)

    def close(self, comm: TPComm) -> None:
        """Tell the workers to stop, wait for them, then leave the group."""
        self._closing.set()
        if self.failure is None:
            try:
                with comm.lock:
                    comm.send_header(StepKind.STOP)
            except RuntimeError as err:
                logger.warning("tensor-parallel stop not delivered: %s", err)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs.values():
            p.join(max(deadline - time.monotonic(), 0.0))
        self.terminate()
        comm.close()


def run_node(cfg: EngineConfig) -> int:
    """`serve --node-rank K` (K > 0): this node's workers only; returns when they end (0 when
    all stopped cleanly, 1 when one failed: the others are stopped)."""
    ranks = _node_ranks(cfg)
    assert cfg.dist_init_addr is not None  # EngineConfig requires it with nnodes > 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s node: %(message)s")
    logger.info("node %d of %d: tensor-parallel ranks %d-%d, rank 0 at %s", cfg.node_rank,
                cfg.nnodes, ranks[0], ranks[-1], cfg.dist_init_addr)
    procs = _spawn(cfg, ranks, f"tcp://{cfg.dist_init_addr}")
    signal.signal(signal.SIGTERM, lambda *_: [p.terminate() for p in procs.values()])
    pending = {p.sentinel: p for p in procs.values()}
    code = 0
    while pending:
        for sentinel in mp.connection.wait(list(pending)):
            proc = pending.pop(sentinel)
            proc.join()
            if proc.exitcode != 0 and code == 0:
                logger.error("%s %s: stopping this node", proc.name, describe_exit(proc.exitcode))
                code = 1
                for other in pending.values():
                    other.terminate()
    return code
