"""The file-system calls of a BlockStore, each behind the store's injected delay.

Owns: listing a tier directory, writing a temp file in one writev, unlinking quietly, and the
per-operation delay (`FileOps.delay_s`: 0 in service; a test or bench sets it to model a slow
or remote disk, e.g. 50 ms per operation). Does not know: the index, the lock, the block
format. Nothing here is called with the store's lock held.
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from radixserve.cache.tiers.block_keys import is_key

SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
TEMP_GRACE_S = 60.0  # a temp file younger than this may be a live writer's (any process)


@dataclass(frozen=True)
class Listing:
    blocks: dict[str, tuple[float, int]]  # key -> (mtime, size) of `<key>.kvb`
    stale_temps: list[str]  # temp files older than TEMP_GRACE_S
    dir_mtime_ns: int


class FileOps:
    def __init__(self, root: Path, delay_s: float = 0.0) -> None:
        self.root = root
        self.delay_s = delay_s

    def _wait(self) -> None:
        if self.delay_s > 0:
            time.sleep(self.delay_s)

    def dir_mtime_ns(self) -> int:
        self._wait()
        return os.stat(self.root).st_mtime_ns

    def listing(self, known: set[str]) -> Listing:
        """Every block file (stat only for keys not in `known`: their size and mtime are
        needed to index them) and the stale temp files. Raises OSError."""
        mtime_ns = self.dir_mtime_ns()
        self._wait()
        blocks: dict[str, tuple[float, int]] = {}
        stale: list[str] = []
        now = time.time()
        with os.scandir(self.root) as it:
            entries = list(it)
        for entry in entries:
            name = entry.name
            if name.endswith(SUFFIX) and is_key(name[: -len(SUFFIX)]):
                key = name[: -len(SUFFIX)]
                blocks[key] = (0.0, 0) if key in known else self._stat(entry)
            elif name.startswith(".") and name.endswith(TEMP_SUFFIX):
                if now - self._stat(entry)[0] > TEMP_GRACE_S:
                    stale.append(name)
        return Listing({k: v for k, v in blocks.items() if v[1] >= 0}, stale, mtime_ns)

    def _stat(self, entry: os.DirEntry[str]) -> tuple[float, int]:
        self._wait()
        try:
            st = entry.stat()
        except OSError:
            return 0.0, -1  # vanished since the listing
        return st.st_mtime, st.st_size

    def stat(self, path: Path) -> os.stat_result | None:
        """None: the file is gone (or cannot be looked at: as good as gone)."""
        self._wait()
        try:
            return os.stat(path)
        except OSError:
            return None

    def touch(self, path: Path) -> int | None:
        """Mark a block read now (every replica sees it in the file's mtime); the mtime set,
        in ns, or None when it could not be set."""
        self._wait()
        now = time.time_ns()
        try:
            os.utime(path, ns=(now, now))
        except OSError:
            return None  # vanished or read-only: only the recency hint is lost
        return now

    def read(self, path: Path) -> bytes:
        self._wait()
        with open(path, "rb", buffering=0) as f:
            return f.read()  # one sequential read of the whole file

    def write_temp(self, key: str, bufs: tuple[bytes, memoryview, bytes], durable: bool
                   ) -> tuple[Path, int]:
        """A new temp file holding `bufs`, fsynced when durable, and its mtime in ns (a
        rename keeps it). Raises OSError (the partial file is removed)."""
        tmp = self.root / (f".{key}.{os.getpid()}.{threading.get_ident()}."
                           f"{secrets.token_hex(4)}{TEMP_SUFFIX}")
        self._wait()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, bufs)
                if durable:
                    os.fsync(fd)
                mtime_ns = os.fstat(fd).st_mtime_ns
            finally:
                os.close(fd)
        except OSError:
            self.unlink(tmp)
            raise
        return tmp, mtime_ns

    def replace(self, src: Path, dst: Path) -> None:
        self._wait()
        os.replace(src, dst)

    def unlink(self, path: Path) -> None:
        self._wait()
        try:
            os.unlink(path)
        except OSError:
            pass  # gone already, or cannot be removed: no longer indexed, so never read


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
