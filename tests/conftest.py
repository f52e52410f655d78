"""Shared fixtures: tiny models (session-scoped), markers."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch  # importing torch does not import triton

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors under its interpreter. The variable must be set
    # before anything imports triton (transformers does, via tests.tiny_models).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.tiny_models import make_tiny_model, make_tokenizer  # noqa: E402

SOAK_ENV = "RADIXSERVE_SOAK_S"  # seconds of the opt-in soak/chaos runs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `soak` tests are off by default: on with `-m soak` or RADIXSERVE_SOAK_S=<seconds>.
    if "soak" not in (config.getoption("-m") or "") and not os.environ.get(SOAK_ENV):
        skip_soak = pytest.mark.skip(reason=f"opt-in: -m soak or {SOAK_ENV}=<seconds>")
        for item in items:
            if "soak" in item.keywords:
                item.add_marker(skip_soak)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _native_cpu_kernels_built() -> None:
    """Build the native CPU attention kernels (one extension: paged decode and causal
    prefill) once, before any test starts an engine: a first
    build (~20 s, more on a loaded machine; cached afterwards) must not eat into a test's
    wait for a server to become healthy. A failed build is tested by test_cpu_kernels.py."""
    from radixserve.attention.cpu_kernels import load_paged_decode
    from radixserve.engine.sampler import load_greedy_argmax
    from radixserve.model.int8_kernel import load_int8_gemm

    load_paged_decode()
    load_int8_gemm()  # and the int8 GEMM (tests/model/test_int8_kernel.py)
    load_greedy_argmax(torch.device("cpu"))  # and the sampler's argmax (every engine's)


# The CPU tiers this host executes (RADIXSERVE_CPU_ISA can select each): the native-kernel tests
# run under every one. The best tier runs a module's full set; a lower tier every third case
# (chosen by the case's id, so the same ones each run) and every case without parameters.
from radixserve.platform.cpu_isa import ENV_CPU_ISA, CpuIsa, host_tiers  # noqa: E402

HOST_TIERS = host_tiers()


@pytest.fixture(params=[t.value for t in HOST_TIERS])
def cpu_tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> CpuIsa:
    """Run the test with its native kernels at one tier ($RADIXSERVE_CPU_ISA)."""
    tier = CpuIsa(request.param)
    callspec = getattr(request.node, "callspec", None)
    if tier is not HOST_TIERS[-1] and callspec is not None and len(callspec.params) > 1:
        case = request.node.name.replace(f"{tier.value}-", "").replace(f"-{tier.value}", "")
        if zlib.crc32(f"{request.node.module.__name__}::{case}".encode()) % 3:
            pytest.skip(f"{tier.value}: a representative third of the cases; the best tier "
                        f"({HOST_TIERS[-1].value}) runs them all")
    monkeypatch.setenv(ENV_CPU_ISA, tier.value)
    return tier


@pytest.fixture
def broken_native_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process whose native builds fail (a compiler error), whatever is already loaded or
    cached: the loaders must fall back to torch. Failure markers go to a temporary folder."""
    import torch.utils.cpp_extension as cpp_extension

    from radixserve.platform import kernels, native_build

    def broken(**_: object) -> None:
        raise RuntimeError("Error building extension 'x':\nk.cpp:1:1: error: no compiler here")

    def new_process() -> None:
        native_build.build_extension.cache_clear()
        kernels._load.cache_clear()

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(native_build.NativeExtension, "registered", lambda self, tier: False)
    monkeypatch.setattr(cpp_extension, "load", broken)
    new_process()
    yield
    new_process()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_llama_tied"), "llama", tie_word_embeddings=True,
        num_kv_heads=1,
    )


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", num_kv_heads=2)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder holding only the test tokenizer: what the fake engine's server loads."""
    path = tmp_path_factory.mktemp("fake_model")
    make_tokenizer().save_pretrained(path)
    return path
