"""Tier stores across processes: two replicas writing one block at once, and a writer SIGKILLed
in the middle of a block (its temp file never becomes a block and is cleaned up later)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from radixserve.cache.tiers import BlockStore, MissReason, StoreStatus, Tier
from tests.cache.tiers.block_stores import BLOCK, FP, key, payload
from tests.repo import REPO_ROOT

REPO = REPO_ROOT

_PRELUDE = """
import os, sys
from pathlib import Path
from radixserve.cache.tiers import BlockStore, Tier
from tests.cache.tiers.block_stores import FP, key, payload
root = Path(sys.argv[1])
"""

# Rewrites one block over and over through fresh stores (each one's put renames over the
# other process's file), as two replicas publishing the same prefix would.
_REWRITER = _PRELUDE + """
for _ in range(int(sys.argv[2])):
    s = BlockStore(root, 1 << 30, FP, Tier.SHARED, scan=False, durable=False)
    assert s.put(key(0), payload(0, 200_000)).value == "stored"
"""

# Writes part of one big block, says so, then stalls inside the write until killed.
_STALLED = _PRELUDE + """
import time
real = os.writev
def partial(fd, bufs):
    n = real(fd, [memoryview(bufs[0]), memoryview(bufs[1])[: 1 << 20]])
    print("writing", flush=True)
    time.sleep(600)
    return n
os.writev = partial
BlockStore(root, 1 << 30, FP, Tier.LOCAL, scan=False).put(key(0), b"x" * (64 << 20))
"""


def _spawn(script: str, *args: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
                            env=env, stdout=subprocess.PIPE, text=True)


def test_two_processes_write_one_block_reader_never_sees_a_torn_one(tmp_path: Path) -> None:
    writers = [_spawn(_REWRITER, tmp_path, 60) for _ in range(2)]
    reader = BlockStore(tmp_path, 1 << 30, FP, Tier.SHARED, scan=False)
    seen: set[MissReason | None] = set()
    try:
        while any(w.poll() is None for w in writers):
            reader.refresh()
            r = reader.get(key(0))
            assert r.data is None or r.data == payload(0, 200_000)
            seen.add(r.miss)
    finally:
        for w in writers:
            w.kill() if w.poll() is None else None
            w.wait(timeout=60)
    assert [w.returncode for w in writers] == [0, 0]
    assert seen <= {None, MissReason.ABSENT}  # absent only before the first rename
    reader.refresh()
    assert reader.get(key(0)).data == payload(0, 200_000)
    assert os.listdir(tmp_path) == [f"{key(0)}.kvb"]  # both writers' temps renamed away
    reader.check_integrity()


def test_writer_sigkilled_mid_write_leaves_no_block(tmp_path: Path) -> None:
    child = _spawn(_STALLED, tmp_path)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "writing"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    (temp,) = os.listdir(tmp_path)
    assert temp.startswith(f".{key(0)}.") and temp.endswith(".tmp")
    restarted = BlockStore(tmp_path, 1 << 30, FP, Tier.LOCAL)
    assert restarted.keys() == [] and restarted.get(key(0)).miss is MissReason.ABSENT
    assert (tmp_path / temp).exists()  # under a minute old: maybe a live writer's, kept
    os.utime(tmp_path / temp, (1, 1))
    restarted.refresh()
    assert os.listdir(tmp_path) == []
    assert restarted.put(key(0), payload(0)) is StoreStatus.STORED
    assert restarted.stats().bytes_used == BLOCK
    restarted.check_integrity()
