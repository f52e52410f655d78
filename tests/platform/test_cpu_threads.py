"""The engine's default thread count: every usable core but one, from the affinity mask."""

from __future__ import annotations

import os

import pytest

from radixserve.platform import cpu_threads
from radixserve.platform.cpu_threads import choose_num_threads, default_num_threads


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (3, 2), (4, 3), (16, 15),
                                                (64, 63)])
def test_default_leaves_one_core_and_has_no_cap(cores: int, threads: int) -> None:
    choice = default_num_threads(cores)
    assert (choice.num_threads, choice.usable_cores) == (threads, cores)


def test_usable_cores_follow_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 5, 7, 11, 13})
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    assert cpu_threads.usable_cores() == 6
    choice = choose_num_threads(None)
    assert choice.num_threads == 5
    assert choice.reason == "6 usable cores, one left to the API process"


def test_configured_threads_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    choice = choose_num_threads(2)
    assert (choice.num_threads, choice.usable_cores) == (2, 2)
    assert choice.reason == "set by --num-threads; 2 usable cores"
