"""The SmolLM2 replicas this package's failover tests share (tests/router/proxy/smollm2_fleet.py):
started by the first test that asks for them, stopped by their handles after the package."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tests.router.proxy.smollm2_fleet import Replicas


@pytest.fixture(scope="package")
def smollm2_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    with contextlib.ExitStack() as stack:
        yield Replicas(tmp_path_factory.mktemp("smollm2_replicas"), stack)
