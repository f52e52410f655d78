"""The scheduler's LoRA rules: a request waits for its adapter, a batch holds at most
`--max-loras` adapters, and decoding requests of one adapter stay next to each other.

Owns: the admission test of a request that names an adapter (loaded: it takes the adapter and
its radix namespace; loading: it waits, the batch does not; failed: it ends with the error),
the per-batch adapter bound, and where a request joins the running list. Acts on the
scheduler's behalf (Scheduler.set_lora / fail). Does not know: weights or files
(lora/manager.py), tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from radixserve.lora.manager import LoadFailed

if TYPE_CHECKING:
    from radixserve.lora.manager import LoRAManager
    from radixserve.sched.req import Req
    from radixserve.sched.scheduler import Scheduler


class LoRAGate:
    def __init__(self, manager: LoRAManager, max_loras: int) -> None:
        self.manager = manager
        self.max_loras = max_loras

    def batch_adapters(self, live: Iterable[Req]) -> set[str]:
        return {r.lora_name for r in live if r.lora_name is not None}

    def admissible(self, s: Scheduler, req: Req, adapters: set[str]) -> bool:
        """Whether `req` may join a batch whose live requests use `adapters` (adds its own
        when it does). Polls its adapter's load; a failed load fails the request."""
        name = req.lora_name
        if name is None:
            return True  # the base model takes no adapter slot
        if req.lora is None:
            got = self.manager.poll(name)
            if got is None:
                return False  # loading off the step: it waits, the batch does not
            if isinstance(got, LoadFailed):
                s.fail(req, got.message)
                return False
            s.set_lora(req, got)
        if name not in adapters and len(adapters) >= self.max_loras:
            return False  # --max-loras adapters already in the batch: next time
        adapters.add(name)
        return True

    def trim(self, s: Scheduler) -> None:
        """Keep the loaded adapters within --max-cpu-loras, sparing every one in use."""
        if self.manager.over_capacity():
            self.manager.trim(self.batch_adapters([*s.running, *s.prefilling, *s.waiting]))

    @staticmethod
    def join_position(running: list[Req], req: Req) -> int:
        """Where `req` joins the running list: after the last request of its adapter, so one
        adapter's decode tokens are one contiguous segment (one GEMM pair per target)."""
        for i in range(len(running) - 1, -1, -1):
            if running[i].lora_name == req.lora_name:
                return i + 1
        return len(running)
