"""The tiers' test model: a tiny Llama whose prefill is compute-heavy next to its small KV
(hidden 512, eight heads of 64, one KV head), so that loading a prefix is clearly cheaper than recomputing it on
any CPU, as it is for a real model (SmolLM2-135M: ~46 KB of fp32 KV per token against ~0.3
GFLOP of compute). The load-or-recompute choice then loads on its own measurements: no test
bypasses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tier_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tier_model"), "llama", hidden_size=512,
                           num_heads=8, num_kv_heads=1)
