"""NCCL failure handling (issue 42, defect 4): collectives return when queued, so rank 0 waits for
a step's collectives itself, asking its monitor between polls, and gives up after a deadline.
CPU tests drive the wait with fake events (a GPU that never finishes) and fake workers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixserve.engine.tp_lead import TPLead
from radixserve.engine.tp_ranks import TPFailedError
from radixserve.parallel.completion import CollectiveTimeout, CollectiveTimer, wait_done


class NeverDone:
    """A CUDA event whose work never finishes (a peer died inside a collective)."""

    def __init__(self) -> None:
        self.polls = 0

    def query(self) -> bool:
        self.polls += 1
        return False


class DyingWorkers:
    """The monitor learns of rank 1's death at its `after`-th check."""

    def __init__(self, after: int) -> None:
        self.after, self.checks = after, 0

    def check(self) -> None:
        self.checks += 1
        if self.checks > self.after:
            raise TPFailedError("tensor-parallel rank 1 (pid 42) was killed by SIGKILL")

    def error_for(self, err: BaseException) -> TPFailedError:
        return err if isinstance(err, TPFailedError) else TPFailedError(str(err))


class QueuingComm:
    """NCCL-like: every collective 'succeeds' at once; only wait() sees the hang."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.sent: list[Any] = []

    def send_header(self, kind: Any, n: int = 0) -> None:
        self.sent.append(kind)

    def send_payload(self, payload: torch.Tensor) -> None:
        self.sent.append(payload.numel())

    def wait(self, check: Any, timeout_s: float = 300.0, what: str = "") -> None:
        wait_done(NeverDone(), check, timeout_s, what)


def test_a_dead_rank_found_while_waiting_raises_its_error() -> None:
    workers = DyingWorkers(after=3)
    with pytest.raises(TPFailedError, match="SIGKILL"):
        wait_done(NeverDone(), workers.check, timeout_s=60.0)
    assert workers.checks == 4


def test_a_hung_peer_times_out() -> None:
    event = NeverDone()
    with pytest.raises(CollectiveTimeout, match="did not finish within 0 s"):
        wait_done(event, lambda: None, timeout_s=0.2)
    assert event.polls > 1


def test_lead_forward_raises_when_a_rank_dies_during_queued_collectives() -> None:
    from tests.engine.test_tp_step import decode_step

    lead = TPLead(QueuingComm(), DyingWorkers(after=2))  # type: ignore[arg-type]
    with pytest.raises(TPFailedError, match="rank 1"):
        lead.forward(decode_step(torch.zeros(8, 128, dtype=torch.int32)),
                     lambda inputs: torch.zeros(3, 8))
    assert lead.steps == 0


def test_timer_counts_host_time_where_collectives_are_synchronous() -> None:
    timer = CollectiveTimer(torch.device("cpu"))
    token = timer.start()
    sum(range(10000))
    timer.stop(token)
    assert timer.count == 1 and timer.seconds > 0 and timer.done_event() is None


@pytest.mark.gpu
def test_timer_measures_the_gpu_work_not_the_launch() -> None:
    timer = CollectiveTimer(torch.device("cuda"))
    x = torch.randn(4096, 4096, device="cuda")
    token = timer.start()
    for _ in range(20):
        x = x @ x
        x /= x.norm()
    timer.stop(token)
    done = timer.done_event()
    assert done is not None
    wait_done(done, lambda: None, 60.0)
    assert timer.seconds > 1e-3
