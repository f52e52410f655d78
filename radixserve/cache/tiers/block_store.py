"""BlockStore: one directory of KV blocks (the local tier, or the tier replicas share).

Owns: the files under `root` that it indexed, their LRU order and byte bound, and the write
protocol. Does not know: the radix tree (it reports evicted keys through take_evicted()), what
a payload means, other processes (it only sees what is on disk).

Files: `<key>.kvb` in block_format's layout, mode 0600. A put writes a unique temp name
`.<key>.<pid>.<thread>.<random>.tmp` in the same directory, fsyncs it and os.replace()s it, so
a reader sees either no file or a whole one; two writers of one key both write valid files and
the last rename wins. A writer killed mid-write leaves only a temp file, which is never read as
a block and is unlinked by a later scan/refresh once older than TEMP_GRACE_S (a younger one may
belong to a live writer in another process).

Thread safety: one lock guards the index; file writes and reads run outside it (a worker
thread loads while the engine thread calls contains()), but renames and unlinks of indexed
files run under it, so the index and this process's own files never disagree.

Shared tier (tier=Tier.SHARED): other processes add and delete files. contains() sees added
files after refresh(); a file deleted by another process is a miss (ABSENT) and leaves the
index at get() or refresh(); a corrupt file is dropped from the index but not unlinked (another
process may be about to replace it with a good one). Eviction only deletes indexed files.
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from radixserve.cache.radix_types import Tier
from radixserve.cache.tiers import block_format
from radixserve.cache.tiers.block_keys import (
    Fingerprint,
    LoadResult,
    MissReason,
    StoreStatus,
    is_key,
)
from radixserve.cache.tiers.lru_index import IndexedStore

SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
TEMP_GRACE_S = 60.0  # a temp file younger than this may be a live writer's (any process)
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class _Listing:
    blocks: dict[str, os.DirEntry[str]]  # key -> entry of `<key>.kvb`
    stale_temps: list[str]  # temp files older than TEMP_GRACE_S


class BlockStore(IndexedStore):
    def __init__(self, root: Path, capacity_bytes: int, fp: Fingerprint, tier: Tier, *,
                 scan: bool = True, durable: bool = True) -> None:
        if tier is Tier.POOL:
            raise ValueError("a BlockStore is a LOCAL or SHARED tier, not the pool")
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        super().__init__(capacity_bytes, tier)
        self.fp = fp
        self.durable = durable  # False: skip fsync (tests, or a tier that need not survive)
        self._digest = fp.digest()
        if scan:
            self.refresh()

    # -- queries (contains/keys/take_evicted/stats: IndexedStore) ------------------------------

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    # -- put -----------------------------------------------------------------------------------

    def put(self, key: str, payload: bytes | memoryview) -> StoreStatus:
        """Store one block; never raises for IO faults (NO_SPACE / ERROR, counted)."""
        if not is_key(key):
            raise ValueError(f"not a block key: {key!r}")
        t0 = time.perf_counter()
        payload = memoryview(payload).cast("B")
        size = block_format.stored_size(key, len(payload))
        with self._lock:
            refused = self._refuse(key, size)
        if refused is not None:
            return refused
        header = block_format.encode_header(key, self._digest, len(payload))
        trailer = block_format.encode_checksum(header, payload)
        tmp = self.root / _temp_name(key)
        status = self._write_temp(tmp, (header, payload, trailer))
        if status is StoreStatus.STORED:
            status = self._publish(key, tmp, size)
        if status is not StoreStatus.STORED:
            _unlink_quiet(tmp)
            return status
        with self._lock:
            self._counters.note_store(len(payload), time.perf_counter() - t0)
        return status

    def _write_temp(self, tmp: Path, bufs: tuple[bytes, memoryview, bytes]) -> StoreStatus:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, bufs)
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            return self._write_failed(e)
        return StoreStatus.STORED

    def _publish(self, key: str, tmp: Path, size: int) -> StoreStatus:
        """Rename the finished temp file into place, evicting LRU blocks to make room."""
        with self._lock:
            if key in self._index:  # another thread of this process stored it meanwhile
                return StoreStatus.EXISTS
            victims = self._index.plan_room(size)
            if victims is None:
                self._counters.errors["no_space"] += 1
                return StoreStatus.NO_SPACE
            for victim in victims:
                _unlink_quiet(self.path(victim))
            try:
                os.replace(tmp, self.path(key))
            except OSError as e:
                return self._count_write_error(e)
            self._index.add(key, size)
        return StoreStatus.STORED

    def _write_failed(self, e: OSError) -> StoreStatus:
        """Count a failed write (the caller must not hold the lock) and classify it."""
        with self._lock:
            return self._count_write_error(e)

    def _count_write_error(self, e: OSError) -> StoreStatus:
        no_space = e.errno in _NO_SPACE_ERRNOS
        self._counters.errors["no_space" if no_space else "write_error"] += 1
        return StoreStatus.NO_SPACE if no_space else StoreStatus.ERROR

    # -- get / delete --------------------------------------------------------------------------

    def get(self, key: str) -> LoadResult:
        """The block's payload, or a miss with its reason (counted); never raises for IO."""
        with self._lock:
            if key not in self._index:
                self._counters.misses += 1
                return LoadResult(None, MissReason.ABSENT)
        t0 = time.perf_counter()
        try:
            with open(self.path(key), "rb", buffering=0) as f:
                data = f.read()  # one sequential read of the whole file
        except FileNotFoundError:
            return self._miss(key, MissReason.ABSENT, "vanished", drop=True)
        except OSError:
            return self._miss(key, MissReason.IO_ERROR, "io_error", drop=False)
        payload, reason = block_format.decode(data, key, self._digest)
        if payload is None:
            assert reason is not None
            return self._miss(key, reason, reason.value, drop=True)
        out = bytes(payload)
        with self._lock:
            self._index.touch(key)
            self._counters.note_hit(len(out), time.perf_counter() - t0)
        return LoadResult(out, None)

    def _miss(self, key: str, reason: MissReason, kind: str, *, drop: bool) -> LoadResult:
        with self._lock:
            self._counters.misses += 1
            self._counters.errors[kind] += 1
            if drop and self._index.remove(key) and reason is not MissReason.ABSENT:
                if self.tier is not Tier.SHARED:
                    _unlink_quiet(self.path(key))
        return LoadResult(None, reason)

    def delete(self, key: str) -> None:
        with self._lock:
            self._index.remove(key)
            _unlink_quiet(self.path(key))

    # -- directory scans -----------------------------------------------------------------------

    def refresh(self) -> None:
        """Re-scan the directory: index blocks other processes (or a previous life) wrote, as
        most recent in mtime order; drop entries whose file vanished; unlink stale temp files;
        evict down to capacity. One os.scandir plus a stat per new file. Never raises for IO:
        an unreadable directory is counted (errors["scan_error"]) and changes nothing."""
        try:
            listing = self._list()
        except OSError:
            with self._lock:
                self._counters.errors["scan_error"] += 1
            return
        with self._lock:
            known = set(self._index.sizes)
        fresh: list[tuple[float, str, int]] = []
        for key, entry in listing.blocks.items():
            if key in known:
                continue
            try:
                st = entry.stat()
            except OSError:
                continue  # vanished since the listing
            if st.st_size >= block_format.MIN_SIZE:
                fresh.append((st.st_mtime, key, st.st_size))
        fresh.sort()
        for tmp in listing.stale_temps:
            _unlink_quiet(self.root / tmp)
        with self._lock:
            for key in [k for k in self._index.sizes if k not in listing.blocks]:
                if not self.path(key).exists():  # not a put that landed after the listing
                    self._index.remove(key)
                    self._index.evicted.append(key)
            for _, key, size in fresh:
                if key not in self._index:
                    self._index.add(key, size)
            self._evict_to_capacity()

    def _evict_to_capacity(self) -> None:
        victims = self._index.plan_room(0)
        while victims is None and len(self._index):  # unreachable unless capacity shrank to 0
            oldest = next(iter(self._index.sizes))
            self._index.remove(oldest)
            self._index.evicted.append(oldest)
            victims = [oldest]
        for victim in victims or []:
            _unlink_quiet(self.path(victim))

    def _list(self) -> _Listing:
        blocks: dict[str, os.DirEntry[str]] = {}
        stale: list[str] = []
        now = time.time()
        with os.scandir(self.root) as it:
            for entry in it:
                name = entry.name
                if name.endswith(SUFFIX) and is_key(name[: -len(SUFFIX)]):
                    blocks[name[: -len(SUFFIX)]] = entry
                elif name.startswith(".") and name.endswith(TEMP_SUFFIX):
                    try:
                        if now - entry.stat().st_mtime > TEMP_GRACE_S:
                            stale.append(name)
                    except OSError:
                        pass
        return _Listing(blocks, stale)

    def check_integrity(self) -> None:
        """Index bytes recount against the files. A file deleted, or whose size changed, behind
        the store's back (another replica on the shared tier; a disk fault or an operator on
        either) leaves the index and is reported through take_evicted(), so the tree forgets
        it: a miss, never an integrity failure of the engine (a size change also counts as
        "truncated")."""
        with self._lock:
            self._index.check()
            assert self._index.bytes_used <= self._index.capacity, "over capacity"
            for key, size in list(self._index.sizes.items()):
                try:
                    on_disk = self.path(key).stat().st_size
                except FileNotFoundError:  # deleted behind our back: forgotten, reported
                    self._index.remove(key)
                    self._index.evicted.append(key)
                    continue
                if on_disk != size:  # cut or replaced behind our back: a miss, not a bug
                    self._index.remove(key)
                    self._index.evicted.append(key)
                    self._counters.errors["truncated"] += 1


def _write_all(fd: int, bufs: tuple[bytes, memoryview, bytes]) -> None:
    """One writev for the whole block (a loop only if the kernel writes it partly)."""
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.writev(fd, views)
        if n <= 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _temp_name(key: str) -> str:
    return f".{key}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        pass  # a file we cannot remove stays; it is no longer indexed, so never read
