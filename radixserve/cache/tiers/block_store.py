"""BlockStore: one directory of KV blocks (the local tier, or the tier replicas share).

Owns: the files under `root` that it indexed, their LRU order and byte bound, and the write
protocol. Does not know: the radix tree (it reports evicted keys through take_evicted()), what
a payload means, other processes (it only sees what is on disk), the file-system calls
themselves (block_files.py, with the injectable per-operation delay).

Files: `<key>.kvb` in block_format's layout, mode 0600. A put writes a unique temp name
`.<key>.<pid>.<thread>.<random>.tmp` in the same directory, fsyncs it and os.replace()s it, so
a reader sees either no file or a whole one; two writers of one key both write valid files and
the last rename wins. A writer killed mid-write leaves only a temp file, which is never read as
a block and is unlinked by a later refresh once older than TEMP_GRACE_S.

Thread safety: one lock guards the index and the counters, and is never held across a
file-system call: a put reserves its index entry under the lock (marked publishing until its
rename lands, so a reader meanwhile sees a miss, never a vanished file), renames and unlinks
outside it. contains() reads the in-memory index without the lock.

Shared tier (tier=Tier.SHARED): other processes add and delete files. contains() sees added
files after refresh() (the writer thread's, every second, incremental: the directory is listed
again only when its mtime changed, or every FULL_SCAN_S); a file deleted by another process is
a miss (ABSENT) and leaves the index at get() or refresh(); a corrupt file is dropped from the
index but not unlinked (another process may be about to replace it with a good one).
What a replica counts against its bound (--kv-shared-size): every block in its index (those it
wrote, and those other replicas of its model wrote that a listing added), plus the blocks it
evicted but may not delete yet ("held": still on disk, no longer read by this replica), until
their file is deleted or gone. The count never exceeds the bound: a write that only held
blocks' room could make is refused (no_space). A listing's new blocks that do not fit are
not counted: recently used ones are another replica's, idle ones are deleted.
What a replica may delete: only blocks of its model's namespace that it indexed (or a listing
found idle and past its bound), only when its bound needs the room, and never a block another
replica read or wrote in the last RECENT_S: every read sets the file's mtime (visible to all
replicas); a file whose mtime is still the one this replica set (its own write or read) was
used by no other replica since. A block in recent use elsewhere is held, and deleted by a
later listing once it has been idle RECENT_S (so within RECENT_S + FULL_SCAN_S).
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

from radixserve.cache.radix_types import Tier
from radixserve.cache.tiers import block_format
from radixserve.cache.tiers.block_files import SUFFIX, FileOps, Listing
from radixserve.cache.tiers.block_keys import (
    Fingerprint,
    LoadResult,
    MissReason,
    StoreStatus,
    is_key,
)
from radixserve.cache.tiers.lru_index import IndexedStore

RECENT_S = 60.0  # a shared block read (by any replica) this recently is never deleted
FULL_SCAN_S = 30.0  # the shared directory is listed at least this often (stale temps, aging)
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class BlockStore(IndexedStore):
    def __init__(self, root: Path, capacity_bytes: int, fp: Fingerprint, tier: Tier, *,
                 scan: bool = True, durable: bool = True, io_delay_s: float = 0.0) -> None:
        if tier is Tier.POOL:
            raise ValueError("a BlockStore is a LOCAL or SHARED tier, not the pool")
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        super().__init__(capacity_bytes, tier)
        self.fp = fp
        self.durable = durable  # False: skip fsync (tests, or a tier that need not survive)
        self.files = FileOps(self.root, io_delay_s)
        self._digest = fp.digest()
        self._publishing: set[str] = set()  # indexed, rename not landed yet
        self._stamps: dict[str, int] = {}  # shared: key -> the mtime (ns) this replica set
        self._dir_mtime_ns: int | None = None
        self._last_full = 0.0
        if scan:
            self.refresh()

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def get_buffer(self, key: str) -> None:
        """Files have no resident buffer: the loader reads them with get()."""
        return None

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
        try:
            tmp, mtime_ns = self.files.write_temp(key, (header, payload, trailer), self.durable)
        except OSError as e:
            return self._write_failed(e)
        status = self._publish(key, tmp, size, mtime_ns)
        if status is not StoreStatus.STORED:
            self.files.unlink(tmp)
            return status
        with self._lock:
            self._counters.note_store(len(payload), time.perf_counter() - t0)
        return status

    def _publish(self, key: str, tmp: Path, size: int, mtime_ns: int) -> StoreStatus:
        """Rename the finished temp file into place, evicting LRU blocks to make room."""
        with self._lock:
            if key in self._index:  # another thread of this process stored it meanwhile
                return StoreStatus.EXISTS
            victims = self._index.plan_room(size)
            if victims is None:
                self._counters.errors["no_space"] += 1
                return StoreStatus.NO_SPACE
            self._index.add(key, size)
            self._publishing.add(key)
        if not self._free(victims, keep=key):  # only blocks in use elsewhere are left
            with self._lock:
                self._index.remove(key)
                self._publishing.discard(key)
                self._counters.errors["no_space"] += 1
            return StoreStatus.NO_SPACE
        try:
            self.files.replace(tmp, self.path(key))
        except OSError as e:
            with self._lock:
                self._index.remove(key)
                self._publishing.discard(key)
            return self._write_failed(e)
        with self._lock:
            self._publishing.discard(key)
            if self.tier is Tier.SHARED:
                self._stamps[key] = mtime_ns
        return StoreStatus.STORED

    def _free(self, victims: list[tuple[str, int]], keep: str | None = None,
              new: frozenset[str] = frozenset()) -> bool:
        """Delete evicted blocks' files (outside the lock). On the shared tier a block in
        recent use by another replica is held instead (still counted, not deleted) and older
        blocks are evicted in its place; False when only such blocks (and `keep`) are left
        and the bound is still exceeded. A block in `new` (found by this listing, never
        counted) that is in use elsewhere is only left alone."""
        while victims:
            held = []
            for key, size in victims:
                if self.tier is Tier.SHARED and self._in_use_elsewhere(key):
                    if key not in new:
                        held.append((key, size))
                    continue
                self.files.unlink(self.path(key))
                with self._lock:
                    self._stamps.pop(key, None)
            if not held:
                return True
            with self._lock:
                for key, size in held:
                    self._index.hold(key, size)
                    self._stamps.pop(key, None)
                more = self._index.plan_room(0, keep)  # over by the held bytes
            if more is None:
                return False
            victims = more
        return True

    def _in_use_elsewhere(self, key: str) -> bool:
        """Read or written by another replica in the last RECENT_S (its mtime is not the one
        this replica set, and recent)."""
        st = self.files.stat(self.path(key))
        if st is None or st.st_mtime_ns == self._stamps.get(key):
            return False
        return time.time() - st.st_mtime < RECENT_S

    def _write_failed(self, e: OSError) -> StoreStatus:
        """Count a failed write and classify it."""
        no_space = e.errno in _NO_SPACE_ERRNOS
        with self._lock:
            self._counters.errors["no_space" if no_space else "write_error"] += 1
        return StoreStatus.NO_SPACE if no_space else StoreStatus.ERROR

    # -- get / delete --------------------------------------------------------------------------

    def get(self, key: str) -> LoadResult:
        """The block's payload, or a miss with its reason (counted); never raises for IO."""
        with self._lock:
            if key not in self._index or key in self._publishing:
                self._counters.misses += 1
                return LoadResult(None, MissReason.ABSENT)
        t0 = time.perf_counter()
        path = self.path(key)
        try:
            data = self.files.read(path)
        except FileNotFoundError:
            return self._miss(key, MissReason.ABSENT, "vanished", drop=True)
        except OSError:
            return self._miss(key, MissReason.IO_ERROR, "io_error", drop=False)
        payload, reason = block_format.decode(data, key, self._digest)
        if payload is None:
            assert reason is not None
            return self._miss(key, reason, reason.value, drop=True)
        out = bytes(payload)
        stamp = self.files.touch(path) if self.tier is Tier.SHARED else None  # seen by all
        with self._lock:
            if stamp is not None:
                self._stamps[key] = stamp
            self._index.touch(key)
            self._counters.note_hit(len(out), time.perf_counter() - t0)
        return LoadResult(out, None)

    def _miss(self, key: str, reason: MissReason, kind: str, *, drop: bool) -> LoadResult:
        with self._lock:
            self._counters.misses += 1
            self._counters.errors[kind] += 1
            dropped = drop and self._index.remove(key)
            self._stamps.pop(key, None)
        if dropped and reason is not MissReason.ABSENT and self.tier is not Tier.SHARED:
            self.files.unlink(self.path(key))
        return LoadResult(None, reason)

    def delete(self, key: str) -> None:
        with self._lock:
            self._index.remove(key)
            self._index.release(key)
            self._stamps.pop(key, None)
        self.files.unlink(self.path(key))

    # -- directory scans -----------------------------------------------------------------------

    def refresh(self, full: bool = True) -> None:
        """Index blocks other processes (or a previous life) wrote, as most recent in mtime
        order; drop entries whose file vanished; unlink stale temp files; evict down to
        capacity. Not `full` (the writer's periodic call): nothing is listed when the
        directory's mtime is unchanged (but at least every FULL_SCAN_S). Never raises for IO:
        an unreadable directory is counted (errors["scan_error"]) and changes nothing."""
        try:
            if (not full and self.files.dir_mtime_ns() == self._dir_mtime_ns
                    and time.monotonic() - self._last_full < FULL_SCAN_S):
                return
            with self._lock:
                known = set(self._index.sizes)
            listing = self.files.listing(known)
        except OSError:
            with self._lock:
                self._counters.errors["scan_error"] += 1
            return
        self._dir_mtime_ns, self._last_full = listing.dir_mtime_ns, time.monotonic()
        for tmp in listing.stale_temps:
            self.files.unlink(self.root / tmp)
        gone = [k for k in known if k not in listing.blocks]
        gone = [k for k in gone if self.files.stat(self.path(k)) is None]  # not a late put
        self._apply_listing(listing, gone)

    def _apply_listing(self, listing: Listing, gone: list[str]) -> None:
        cold = time.time() - RECENT_S
        with self._lock:
            held = dict(self._index.held)
        # Held blocks: gone, or idle RECENT_S now (deleted here), stop being counted.
        idle = [k for k in held if k in listing.blocks and listing.blocks[k][0] < cold]
        for key in idle:
            self.files.unlink(self.path(key))
        fresh = sorted((mtime, key, size) for key, (mtime, size) in listing.blocks.items()
                       if size >= block_format.MIN_SIZE and key not in held)
        with self._lock:
            for key in held:
                if key not in listing.blocks or key in idle:
                    self._index.release(key)
            for key in gone:
                if key not in self._publishing and self._index.remove(key):
                    self._index.evicted.append(key)
                    self._stamps.pop(key, None)
            new = frozenset(key for _, key, _ in fresh if key not in self._index)
            for _, key, size in fresh:
                if key in new:
                    self._index.add(key, size)
            victims = self._index.plan_room(0) or []
        self._free(victims, new=new)

    def check_integrity(self) -> None:
        """Index bytes recount against the files. A file deleted, or whose size changed, behind
        the store's back (another replica on the shared tier; a disk fault or an operator on
        either) leaves the index and is reported through take_evicted(), so the tree forgets
        it: a miss, never an integrity failure of the engine (a size change also counts as
        "truncated")."""
        with self._lock:
            self._index.check()
            assert self._index.bytes_used <= self._index.capacity, "over capacity"
            sizes = dict(self._index.sizes)
        on_disk = {key: None if (st := self.files.stat(self.path(key))) is None else st.st_size
                   for key in sizes}
        with self._lock:
            for key, size in sizes.items():
                if on_disk[key] == size or self._index.sizes.get(key) != size:
                    continue  # intact, or changed by this process since the listing
                if key in self._publishing:
                    continue
                self._index.remove(key)
                self._index.evicted.append(key)
                if on_disk[key] is not None:  # cut or replaced behind our back: a miss
                    self._counters.errors["truncated"] += 1
