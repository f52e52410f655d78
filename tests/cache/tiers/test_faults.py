"""Faults in the tiers, end to end through the engine (tiny model, fp32): a corrupted block, a
truncated file, a file deleted between the match and the load, a full disk, two writers of
one block, a writer SIGKILLed mid-write. Each is a miss or a clean write error, counted;
never a wrong token, an exception or a leaked page (check_integrity after every step)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from radixserve import LLM
from radixserve.cache.tiers import Tier, block_key
from radixserve.cache.tiers.block_io import BLOCK
from radixserve.cache.tiers.block_loader import LOAD_WORKERS
from radixserve.cache.tiers.kv_tiers import shared_namespace
from radixserve.ipc.messages import GenerateMsg
from radixserve.kv_events.publisher import block_hashes
from tests.cache.tiers.engine_runs import GREEDY, make_llm, prompts, run


@pytest.fixture(scope="module")
def batch() -> list[list[int]]:
    return prompts(2, 200, seed=7)


@pytest.fixture(scope="module")
def reference(tier_model: Path, batch: list[list[int]]) -> list[list[int]]:
    return run(make_llm(tier_model), batch)[0]


def block_file(llm: LLM, root: Path, prompt: list[int], j: int) -> Path:
    tiers = llm.engine.tiers
    assert tiers is not None
    return root / f"{block_key(block_hashes(prompt, BLOCK)[j], tiers.fp)}.kvb"


def warm_dir(tier_model: Path, root: Path, batch: list[list[int]]) -> None:
    with make_llm(tier_model, kv_offload_dir=root) as llm:
        run(llm, batch)


@pytest.mark.parametrize("fault", ["corrupt", "truncated"])
def test_a_bad_block_is_a_counted_miss(tier_model: Path, tmp_path: Path, batch: list[list[int]],
                                       reference: list[list[int]], fault: str) -> None:
    warm_dir(tier_model, tmp_path, batch)
    llm = make_llm(tier_model, kv_offload_dir=tmp_path)
    path = block_file(llm, tmp_path, batch[0], 3)
    data = path.read_bytes()
    if fault == "corrupt":
        path.write_bytes(data[:100] + bytes([data[100] ^ 0x55]) + data[101:])
    else:
        path.write_bytes(data[: len(data) // 2])
    outs, cached = run(llm, batch)
    assert outs == reference
    assert cached[0] == 3 * BLOCK  # blocks 0-2 loaded, the bad one and the rest recomputed
    assert cached[1] >= 12 * BLOCK
    assert llm.kv_stats()["kv_offload"]["errors"].get(fault, 0) >= 1
    llm.close()


def test_a_bad_local_block_is_read_from_the_shared_tier(
        tier_model: Path, tmp_path: Path, batch: list[list[int]],
        reference: list[list[int]]) -> None:
    local, shared = tmp_path / "local", tmp_path / "shared"
    with make_llm(tier_model, kv_offload_dir=local, kv_shared_dir=shared) as warm:
        run(warm, batch)
    llm = make_llm(tier_model, kv_offload_dir=local, kv_shared_dir=shared)
    path = block_file(llm, local, batch[0], 3)
    data = path.read_bytes()
    path.write_bytes(data[:100] + bytes([data[100] ^ 0x55]) + data[101:])
    outs, cached = run(llm, batch)
    assert outs == reference
    assert cached[0] >= 12 * BLOCK  # the bad local block came from the shared tier
    stats = llm.kv_stats()["kv_offload"]
    assert stats["errors"].get("corrupt", 0) >= 1, stats
    llm.close()


def test_a_file_deleted_between_match_and_load(tier_model: Path, tmp_path: Path,
                                               batch: list[list[int]],
                                               reference: list[list[int]]) -> None:
    warm_dir(tier_model, tmp_path, batch)
    llm = make_llm(tier_model, kv_offload_dir=tmp_path)
    tiers = llm.engine.tiers
    assert tiers is not None
    gate = threading.Event()
    for _ in range(LOAD_WORKERS):  # every loader thread waits until the files are gone
        tiers.loader._pool.submit(gate.wait)
    engine = llm.engine
    engine.add_request(GenerateMsg("r", batch[0], GREEDY))
    engine.step()  # probe: the blocks are in the index; the load is queued
    assert engine.scheduler.tier_loads is not None and engine.scheduler.tier_loads.loads
    for j in range(5, 12):
        block_file(llm, tmp_path, batch[0], j).unlink()
    gate.set()
    toks: list[int] = []
    cached = []
    while engine.has_work():
        for o in engine.step():
            toks += [] if o.token_id is None else [o.token_id]
            if o.finish_reason is not None:
                cached.append(o.num_cached_tokens)
        engine.check_integrity()
    assert toks == reference[0] and cached == [5 * BLOCK]
    llm.close()


def test_a_full_disk_is_a_clean_write_error(tier_model: Path, tmp_path: Path,
                                            batch: list[list[int]], reference: list[list[int]],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.cache.tiers import block_files

    def full(fd: int, bufs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(block_files, "_write_all", full)
    llm = make_llm(tier_model, kv_offload_dir=tmp_path, kv_cache_tokens=300, max_model_len=256)
    outs, _ = run(llm, batch + batch)  # each prompt evicts the other: demotions fail
    assert outs == reference + reference
    tiers = llm.engine.tiers
    assert tiers is not None and tiers.writer.flush()
    llm.engine.check_integrity()  # applies the failed writes (the tree forgets them)
    errors = llm.kv_stats()["kv_offload"]["errors"]
    assert errors.get("no_space", 0) >= 1, errors
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    llm.close()


def test_two_writers_of_one_block(tier_model: Path, tmp_path: Path, batch: list[list[int]],
                                  reference: list[list[int]]) -> None:
    shared = tmp_path / "shared"
    a = make_llm(tier_model, kv_shared_dir=shared)
    b = make_llm(tier_model, kv_shared_dir=shared)
    for llm in (a, b):
        llm.engine.add_request(GenerateMsg("same", batch[0], GREEDY))
    while a.engine.has_work() or b.engine.has_work():  # interleaved: both publish each block
        for llm in (a, b):
            if llm.engine.has_work():
                llm.engine.step()
                llm.engine.check_integrity()
    for llm in (a, b):
        tiers = llm.engine.tiers
        assert tiers is not None and tiers.writer.flush()
    c = make_llm(tier_model, kv_shared_dir=shared)
    outs, cached = run(c, batch[:1])
    assert outs == reference[:1] and cached[0] >= 12 * BLOCK
    tiers = c.engine.tiers
    assert tiers is not None
    tiers.stores[Tier.SHARED].check_integrity()
    for llm in (a, b, c):
        llm.close()


WRITER = """
import json, sys
from pathlib import Path
from radixserve.cache.tiers import BlockStore, Fingerprint, Tier
fp = Fingerprint(**json.loads(sys.argv[3]))
src = BlockStore(Path(sys.argv[1]), 1 << 30, fp, Tier.SHARED)
dst = BlockStore(Path(sys.argv[2]), 1 << 30, fp, Tier.SHARED, durable=True)
blocks = [(k, src.get(k).data) for k in src.keys()]
print("ready", flush=True)
while True:  # republish every block, forever: killed somewhere inside a put
    for key, data in blocks:
        dst.delete(key)
        dst.put(key, data)
"""


def test_a_writer_killed_mid_write_leaves_no_wrong_block(tier_model: Path, tmp_path: Path,
                                                         batch: list[list[int]],
                                                         reference: list[list[int]]) -> None:
    """Another replica's writer (real blocks, republished in a loop with fsync) is SIGKILLed
    mid-write; a replica on that directory still computes exactly."""
    import dataclasses
    import json

    src, shared = tmp_path / "src", tmp_path / "shared"
    with make_llm(tier_model, kv_shared_dir=src) as producer:
        run(producer, batch)
        tiers = producer.engine.tiers
        assert tiers is not None and tiers.writer.flush()
        fp = json.dumps(dataclasses.asdict(tiers.fp))
        # The blocks live in the fingerprint's namespace under each --kv-shared-dir.
        src, space = shared_namespace(src, tiers.fp), shared_namespace(shared, tiers.fp)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(src), str(space), fp], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 120
        while len(list(space.glob("*.kvb"))) < 16 and time.monotonic() < deadline:
            assert proc.poll() is None, "the writer died on its own"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(list(space.glob("*.kvb"))) >= 16
    llm = make_llm(tier_model, kv_shared_dir=shared)
    outs, _ = run(llm, batch)
    assert outs == reference
    tiers = llm.engine.tiers
    assert tiers is not None
    tiers.stores[Tier.SHARED].check_integrity()
    llm.close()
