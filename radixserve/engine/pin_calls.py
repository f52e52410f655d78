"""PinCalls: the engine's answers to /cache/pin, /cache/unpin and /cache/pins calls.

Owns: the replies not yet sent and the pins waiting for their prefix's prefill (a pin whose
prefix is not all cached is computed as a one-token request, then pinned). Does not know:
how pins are kept in the tree (sched/pins.py), the IPC transport (engine/loop.py sends the
replies).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from radixserve.ipc.messages import (
    CacheCallMsg,
    CallResultMsg,
    ListPinsMsg,
    PinMsg,
    UnpinMsg,
)
from radixserve.types import InvalidRequestError, SamplingParams, TokenOutput

if TYPE_CHECKING:
    from radixserve.sched.scheduler import Scheduler


class PinCalls:
    def __init__(self, scheduler: Scheduler, radix_cache_disabled: bool) -> None:
        self.scheduler = scheduler
        self.radix_cache_disabled = radix_cache_disabled
        self._replies: list[CallResultMsg] = []
        self._pin_prefills: dict[str, PinMsg] = {}  # rid of the prefill request -> the call

    def client_outputs(self, outputs: list[TokenOutput]) -> list[TokenOutput]:
        """The step's outputs less those of pin prefills (which finish pins, never reach a
        client)."""
        if not self._pin_prefills:
            return outputs
        return [o for o in outputs if not self._pin_prefill_done(o)]

    def call(self, msg: CacheCallMsg) -> None:
        """Answer a pin call now, or (a pin whose prefix must be computed first) after its
        prefill request finishes; replies are collected by drain_replies()."""
        pins = self.scheduler.pins
        try:
            if isinstance(msg, PinMsg):
                self._pin(msg)
            elif isinstance(msg, UnpinMsg):
                n = (pins.release(msg.pin_id) if msg.pin_id is not None
                     else pins.release_matching(msg.token_ids or [], msg.salt))
                self._replies.append(CallResultMsg(msg.call_id, {"released": int(n)}))
            elif isinstance(msg, ListPinsMsg):
                pins.expire()
                now = time.monotonic()
                listed = [p.describe(now) for p in pins.pins.values()]
                self._replies.append(CallResultMsg(msg.call_id, {
                    "pins": listed, "pinned_tokens": pins.pinned_tokens,
                    "max_pinned_tokens": pins.max_pinned_tokens}))
        except InvalidRequestError as err:
            self._replies.append(CallResultMsg(msg.call_id, error=str(err), status=err.status))

    def drain_replies(self) -> list[CallResultMsg]:
        replies, self._replies = self._replies, []
        return replies

    def _pin(self, msg: PinMsg) -> None:
        if self.radix_cache_disabled:
            raise InvalidRequestError("the radix cache is disabled: nothing can be pinned")
        pins = self.scheduler.pins
        pins.check_room(len(msg.token_ids))
        pin = pins.try_pin(msg.token_ids, msg.salt, msg.ttl_s)
        if pin is not None:
            self._replies.append(CallResultMsg(msg.call_id, self._pin_result(pin, 0)))
            return
        # Not all cached yet: compute it as a one-token request, pin when it finishes.
        rid = f"pin-{msg.call_id}"
        self.scheduler.add(rid, list(msg.token_ids), SamplingParams(
            temperature=0, max_tokens=1, ignore_eos=True), msg.salt, priority=-1)
        self._pin_prefills[rid] = msg

    def _pin_prefill_done(self, out: TokenOutput) -> bool:
        """True when `out` belongs to a pin's prefill request (never sent to a client)."""
        msg = self._pin_prefills.get(out.rid)
        if msg is None:
            return False
        if out.finish_reason is not None:
            del self._pin_prefills[out.rid]
            pin = self.scheduler.pins.try_pin(msg.token_ids, msg.salt, msg.ttl_s)
            if pin is None:
                self._replies.append(CallResultMsg(
                    msg.call_id, error="the prefix could not be cached (aborted)", status=503))
            else:
                computed = len(pin.token_ids) - out.num_cached_tokens
                self._replies.append(CallResultMsg(msg.call_id, self._pin_result(pin, computed)))
        return True

    @staticmethod
    def _pin_result(pin: Any, computed: int) -> dict[str, Any]:
        return {"pin_id": pin.pin_id, "num_tokens": len(pin.token_ids),
                "prefilled_tokens": computed}
