"""Which CPU tier runs is said in the start-up log and /server_info (`CPU kernels: avx2 ...`),
the native-vs-torch greedy tokens agree at a capped tier, and a bad $RADIXSERVE_CPU_ISA is a
clear load error before the weights load."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve.config import ConfigError
from radixserve.llm import LLM
from radixserve.platform import kernels
from radixserve.platform.cpu_isa import ENV_CPU_ISA, CpuIsa, choose_tier, host_tiers
from radixserve.types import SamplingParams
from tests.server_proc import running_server

LOWEST_VECTOR = CpuIsa.AVX2 if CpuIsa.AVX2 in host_tiers() else CpuIsa.PORTABLE


def test_the_line_names_the_torch_path_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV_DISABLE, "1")
    assert kernels.kernel_tier_line() == "torch (RADIXSERVE_NO_CPU_KERNELS=1)"


@pytest.mark.usefixtures("broken_native_build")
def test_the_line_names_the_torch_path_when_no_tier_builds() -> None:
    assert kernels.kernel_tier_line() == "torch (the native build failed)"


def test_server_info_and_the_log_name_the_tier(tiny_llama: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    env = {ENV_CPU_ISA: LOWEST_VECTOR.value}
    with running_server(tiny_llama, log, env=env) as srv:
        info = srv.info()
    line = choose_tier(LOWEST_VECTOR.value).describe()
    assert info["cpu_kernels"] == line == info["engine_info"]["cpu_kernels"]
    assert info["cpu_kernels"].startswith(f"{LOWEST_VECTOR.value} (")
    assert f"CPU kernels: {line}" in srv.output()


def test_native_greedy_tokens_equal_the_torch_paths_at_every_tier(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [[1, 5, 9, 13, 2, 7] * 9, [3, 4, 5]]
    params = SamplingParams(max_tokens=12, temperature=0.0)

    def tokens() -> list[list[int]]:
        llm = LLM(str(tiny_llama), dtype="float32", num_threads=1)
        try:
            return [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.close()

    monkeypatch.setenv(kernels.ENV_DISABLE, "1")
    expected = tokens()
    monkeypatch.delenv(kernels.ENV_DISABLE)
    for tier in host_tiers():
        monkeypatch.setenv(ENV_CPU_ISA, tier.value)
        assert tokens() == expected, tier


def test_a_bad_tier_is_a_clear_load_error(tiny_llama: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_CPU_ISA, "avx1024")
    with pytest.raises(ConfigError, match="RADIXSERVE_CPU_ISA='avx1024' names no CPU tier"):
        LLM(str(tiny_llama), dtype="float32", num_threads=1)
