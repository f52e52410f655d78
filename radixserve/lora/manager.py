"""LoRAManager: the engine's adapters: which are known, loaded (an LRU), loading, failed.

Owns: reading adapters off the step (one worker thread: safetensors reads and fusing never
run on the step's thread), the LRU bound `--max-cpu-loras` (an adapter a live or waiting
request uses is never the one dropped), run-time registration and removal, and the load calls'
replies. Does not know: requests' queues (sched/lora_gate.py asks it), the forward (a loaded
PeftAdapter is handed to the model runner through the request).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from radixserve.config.lora_config import LoRAConfig
from radixserve.lora.peft_format import LoRALoadError, PeftAdapter, load_peft_adapter
from radixserve.model.arch import ModelArch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadFailed:
    """An adapter whose folder could not be served: why (the request's 400)."""

    message: str


class LoRAManager:
    def __init__(self, cfg: LoRAConfig, spec: ModelArch, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.cfg = cfg
        self.spec, self.dtype, self.device = spec, dtype, device
        self._paths: dict[str, str] = {m.name: m.path for m in cfg.modules}  # known adapters
        self._loaded: OrderedDict[str, PeftAdapter] = OrderedDict()  # LRU: oldest first
        self._loading: dict[str, Future[PeftAdapter]] = {}
        self._failed: dict[str, LoadFailed] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self.num_loads = 0

    # ---- what requests and calls ask --------------------------------------------------

    def known(self, name: str) -> bool:
        return name in self._paths

    def register(self, name: str, path: str) -> None:
        """Know `name` at `path` (a run-time load, or an offline LoRARequest). Another path
        under a known name replaces it: the next request reads the new folder."""
        if self._paths.get(name) == path:
            return
        self._paths[name] = path
        self._drop(name)

    def unregister(self, name: str) -> bool:
        """Forget `name` (requests already holding it finish with it). False if unknown."""
        if self._paths.pop(name, None) is None:
            return False
        self._drop(name)
        return True

    def start(self, name: str) -> None:
        """Begin loading `name` off the step unless loaded, loading or failed."""
        if name in self._loaded or name in self._loading or name in self._failed:
            return
        path = self._paths[name]
        self._loading[name] = self._pool.submit(self._read, name, path)

    def poll(self, name: str) -> PeftAdapter | LoadFailed | None:
        """The loaded adapter, its load's failure, or None while it loads (then started)."""
        if name not in self._paths:
            return LoadFailed(f"The model `{name}` does not exist (no such LoRA adapter).")
        adapter = self._loaded.get(name)
        if adapter is not None:
            self._loaded.move_to_end(name)
            return adapter
        if name in self._failed:
            return self._failed[name]
        fut = self._loading.get(name)
        if fut is None:
            self.start(name)
            return None
        if not fut.done():
            return None
        del self._loading[name]
        try:
            adapter = fut.result()
        except LoRALoadError as err:
            self._failed[name] = LoadFailed(str(err))
            return self._failed[name]
        except Exception as err:  # noqa: BLE001 - an unreadable file is the request's error
            self._failed[name] = LoadFailed(f"LoRA adapter {name!r}: {type(err).__name__}: {err}")
            return self._failed[name]
        self._loaded[name] = adapter
        self.num_loads += 1
        return adapter

    def forget_failure(self, name: str) -> None:
        """A failed load may be retried (a run-time load call after fixing the folder)."""
        self._failed.pop(name, None)

    def busy(self) -> bool:
        return bool(self._loading)

    def wait_any(self, timeout: float) -> None:
        if self._loading:
            wait(list(self._loading.values()), timeout, return_when="FIRST_COMPLETED")

    @property
    def loaded_names(self) -> list[str]:
        return list(self._loaded)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- helpers -------------------------------------------------------------------------

    def _read(self, name: str, path: str) -> PeftAdapter:
        # The worker thread: file reads, fusing and the copy to the device.
        adapter = load_peft_adapter(name, path, self.spec, self.cfg.max_lora_rank, self.dtype)
        if self.device.type != "cpu":
            adapter = adapter.to(self.device)
        logger.info("LoRA adapter %r loaded from %s (rank %d, %.1f MB)", name, path,
                    adapter.rank, adapter.nbytes / 1e6)
        return adapter

    def _drop(self, name: str) -> None:
        self._loaded.pop(name, None)
        self._failed.pop(name, None)
        fut = self._loading.pop(name, None)
        if fut is not None:
            fut.cancel()  # a read in flight finishes and is discarded

    def over_capacity(self) -> bool:
        return len(self._loaded) > self.cfg.cpu_capacity

    def trim(self, keep: Iterable[str]) -> None:
        """Drop least recently used adapters past --max-cpu-loras, never one in `keep` (the
        adapters of live and waiting requests: a request never waits on its own eviction)."""
        keep = set(keep)
        for name in list(self._loaded):
            if len(self._loaded) <= self.cfg.cpu_capacity:
                return
            if name not in keep:
                del self._loaded[name]
                logger.info("LoRA adapter %r dropped (--max-cpu-loras %d)", name,
                            self.cfg.cpu_capacity)
