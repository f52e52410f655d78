"""TPComm: one tensor-parallel rank's collectives on torch.distributed (gloo on CPU, NCCL on CUDA).

Owns: joining the process group (rank 0's store first, where it counts the workers in while
checking that none died; then the group, with a timeout, so that no collective waits forever on
a rank that hangs), the collectives the sharded forward needs (the row-parallel all-reduce, the
LM head's gather of vocabulary shards to rank 0), the step broadcast (a fixed int64 header,
then the payload it announces), the lock that keeps every collective sequence of a step in
one order on rank 0 (its idle heartbeat shares the group), and the time spent inside
collectives. Does not know: models, steps' contents (engine/tp_step.py packs them), processes.
"""

from __future__ import annotations

import datetime
import enum
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from radixserve.parallel.completion import CollectiveTimer, wait_done

# A backstop for a rank that hangs without dying (a dead rank's closed sockets fail the
# collective at once): generous, since a large prefill chunk or a slow load runs between
# collectives of the other ranks.
COLLECTIVE_TIMEOUT_S = 300.0
PING_TIMEOUT_S = 30.0  # an idle ping is one tiny broadcast: a peer that misses it hangs
HEADER_LEN = 2  # (kind, payload length)
_JOINED = "radixserve/tp_joined"  # the store's count of workers that reached rank 0


class StepKind(enum.IntEnum):
    """What a broadcast header announces to the workers."""

    FORWARD = 1  # a payload follows, then the forward's collectives
    PING = 2  # rank 0 is idle; nothing follows (keeps the idle wait under the timeout)
    STOP = 3  # shut down cleanly


class TPComm:
    def __init__(self, rank: int, size: int, device: torch.device, init_method: str,
                 timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 check_peers: Callable[[], None] | None = None) -> None:
        """`init_method`: tcp://HOST:PORT (rank 0 listens there). `check_peers`: rank 0's
        check of the workers it started, called while it waits for them to join (it raises
        when one died, instead of waiting out the timeout)."""
        self.rank, self.size, self.device = rank, size, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        host, _, port = init_method.removeprefix("tcp://").rpartition(":")
        tcp_store = dist.TCPStore  # type: ignore[attr-defined]
        store = tcp_store(host, int(port), size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
        if rank == 0:
            deadline = time.monotonic() + timeout_s
            while store.add(_JOINED, 0) < size - 1:
                if check_peers is not None:
                    check_peers()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel ranks did not join {init_method} "
                                       f"within {timeout_s:.0f} s")
                time.sleep(0.05)
        else:
            store.add(_JOINED, 1)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=timeout)
        self.lock = threading.Lock()  # rank 0: one step's collectives, or one heartbeat
        self.last_used = time.monotonic()
        self.timer = CollectiveTimer(device)  # inside collectives, since start

    @property
    def is_lead(self) -> bool:
        return self.rank == 0

    @property
    def collective_seconds(self) -> float:
        return self.timer.seconds

    @property
    def num_collectives(self) -> int:
        return self.timer.count

    def _timed(self, t0: object) -> None:
        self.timer.stop(t0)
        self.last_used = time.monotonic()

    def wait(self, check: Callable[[], None], timeout_s: float = COLLECTIVE_TIMEOUT_S,
             what: str = "collectives") -> None:
        """Block until everything queued so far ran (NCCL queues collectives and returns);
        `check` runs meanwhile and raises when a peer is known dead; CollectiveTimeout past
        `timeout_s`. Immediate on gloo, whose collectives are synchronous."""
        done = self.timer.done_event()
        if done is not None:
            wait_done(done, check, timeout_s, what)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (every rank gets the same bits)."""
        t0 = self.timer.start()
        dist.all_reduce(x)
        self._timed(t0)
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rank 0: the ranks' (N, vocab_per_rank) logits side by side, cut to (N, vocab);
        the other ranks: their own shard (nobody reads it)."""
        t0 = self.timer.start()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.is_lead else None
        dist.gather(local.contiguous(), parts, dst=0)
        self._timed(t0)
        if parts is None:
            return local
        return torch.cat(parts, dim=1)[:, :vocab_size]  # (N, vocab)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (the pool size all ranks can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def send_header(self, kind: StepKind, payload_len: int = 0) -> None:
        """Rank 0 (holding the lock): announce a step, a ping or the stop."""
        t0 = self.timer.start()
        header = torch.tensor([int(kind), payload_len], dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        self._timed(t0)

    def send_payload(self, payload: torch.Tensor) -> None:
        t0 = self.timer.start()
        dist.broadcast(payload, src=0)
        self._timed(t0)

    def recv(self) -> tuple[StepKind, torch.Tensor | None]:
        """A worker: the next header, and the payload of a FORWARD."""
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0)
        kind, length = (int(v) for v in header.tolist())
        if kind != StepKind.FORWARD:
            return StepKind(kind), None
        payload = torch.empty(length, dtype=torch.int64, device=self.device)
        dist.broadcast(payload, src=0)
        return StepKind.FORWARD, payload

    def ping_if_idle(self, idle_s: float) -> None:
        """Rank 0's heartbeat thread: a PING when no collective ran for `idle_s` (skipped while
        a step holds the lock)."""
        if time.monotonic() - self.last_used < idle_s or not self.lock.acquire(blocking=False):
            return
        try:
            self.send_header(StepKind.PING)
            # Across nodes no sentinel tells rank 0 that a peer hangs: wait for the ping with
            # a short deadline instead of NCCL's watchdog (COLLECTIVE_TIMEOUT_S).
            self.wait(lambda: None, PING_TIMEOUT_S, "the idle ping")
        finally:
            self.lock.release()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
