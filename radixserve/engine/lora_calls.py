"""LoRACalls: the engine's answers to /v1/load_lora_adapter and /v1/unload_lora_adapter.

Owns: the load calls waiting for their adapter's read (the reply goes out when the worker
thread finishes it; the step never waits) and the replies not yet sent. Does not know: how
adapters are read or kept (lora/manager.py), the IPC transport (engine/loop.py sends replies).
"""

from __future__ import annotations

from radixserve.ipc.messages import CallResultMsg, LoadLoRAMsg, UnloadLoRAMsg
from radixserve.lora.manager import LoadFailed, LoRAManager


class LoRACalls:
    def __init__(self, manager: LoRAManager | None) -> None:
        self.manager = manager
        self._pending: list[LoadLoRAMsg] = []
        self._replies: list[CallResultMsg] = []

    def call(self, msg: LoadLoRAMsg | UnloadLoRAMsg) -> None:
        m = self.manager
        if m is None:
            self._replies.append(CallResultMsg(msg.call_id, error="LoRA is not enabled "
                                               "(start the server with --enable-lora)",
                                               status=400))
            return
        if isinstance(msg, UnloadLoRAMsg):
            if m.unregister(msg.lora_name):
                self._replies.append(CallResultMsg(msg.call_id, {"lora_name": msg.lora_name}))
            else:
                self._replies.append(CallResultMsg(
                    msg.call_id, error=f"The lora adapter '{msg.lora_name}' cannot be found.",
                    status=404))
            return
        m.unregister(msg.lora_name)  # a reload (load_inplace) reads the folder again
        m.register(msg.lora_name, msg.lora_path)
        m.start(msg.lora_name)
        self._pending.append(msg)
        self.poll()

    def poll(self) -> None:
        """Reply to the load calls whose read finished (loaded, or failed: then forgotten)."""
        if self.manager is None or not self._pending:
            return
        left = []
        for msg in self._pending:
            got = self.manager.poll(msg.lora_name)
            if got is None:
                left.append(msg)
            elif isinstance(got, LoadFailed):
                self.manager.unregister(msg.lora_name)
                self._replies.append(CallResultMsg(msg.call_id, error=got.message, status=400))
            else:
                self._replies.append(CallResultMsg(msg.call_id, {
                    "lora_name": got.name, "rank": got.rank, "digest": got.digest}))
        self._pending = left

    def busy(self) -> bool:
        return bool(self._pending)

    def drain_replies(self) -> list[CallResultMsg]:
        replies, self._replies = self._replies, []
        return replies
