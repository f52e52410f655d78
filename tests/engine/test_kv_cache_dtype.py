"""--kv-cache-dtype and --kv-cache-memory-bytes end to end: the flags as the issue writes them,
twice the tokens in the same bytes with fp8, scales from calibration or from the checkpoint,
what /server_info, /metrics and the start-up log say, and the tier identity."""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from radixserve.cli import build_config, build_parser
from radixserve.config import ConfigError, EngineConfig
from radixserve.config.parsing import parse_byte_size
from radixserve.engine.tiers_setup import kv_format_identity
from radixserve.llm import LLM
from radixserve.types import SamplingParams
from tests.server_proc import running_server
from tests.waiting import wait_until_sync

POOL_BYTES = 3 * 2**20


def test_cli_flags_as_the_issue_writes_them() -> None:
    args = build_parser().parse_args(
        ["serve", "--kv-cache-dtype", "fp8", "--kv-cache-memory-bytes", "512M"])
    engine = build_config(args, {}).engine
    assert (engine.kv_cache_dtype, engine.kv_cache_memory_bytes) == ("fp8", 512 * 2**20)
    assert EngineConfig().kv_cache_dtype == "auto"  # the default


@pytest.mark.parametrize(("text", "value"), [("512M", 512 * 2**20), ("1.5G", 3 * 2**29),
                                             ("2g", 2 * 10**9), ("4k", 4000), ("100", 100),
                                             (4096, 4096)])
def test_byte_sizes_read_as_vllm_reads_them(text: object, value: int) -> None:
    assert parse_byte_size(text, "x") == value


@pytest.mark.parametrize("kwargs", [
    {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp4"},
    {"kv_cache_memory_bytes": "12X"}, {"kv_cache_memory_bytes": "0.5"},
    {"kv_cache_memory_bytes": True}, {"kv_cache_memory_bytes": 0},
    {"kv_cache_memory_bytes": "1G", "kv_cache_tokens": 4096},
])
def test_bad_settings_are_config_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def run(llm: LLM) -> list[int]:
    out = llm.generate(["hello world, this is a test of the cache"],
                       SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    return list(out[0].token_ids)


def test_fp8_pool_holds_twice_the_tokens_in_the_same_bytes(tiny_llama: Path) -> None:
    auto = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory_bytes=POOL_BYTES)
    fp8 = LLM(model=str(tiny_llama), dtype="float32", kv_cache_dtype="fp8",
              kv_cache_memory_bytes=POOL_BYTES)
    a, f = auto.engine.info, fp8.engine.info
    assert (a["kv_cache_dtype"], f["kv_cache_dtype"]) == ("auto", "fp8")
    assert (a["kv_cache_storage_dtype"], f["kv_cache_storage_dtype"]) == (
        "float32", "float8_e4m3fn")
    # float32 -> 8 bits: four times the tokens (bfloat16 -> 8 bits: twice)
    assert f["kv_cache_tokens"] == 4 * a["kv_cache_tokens"]
    assert a["kv_cache_bytes"] <= POOL_BYTES and f["kv_cache_bytes"] <= POOL_BYTES
    assert f["kv_cache_bytes"] == a["kv_cache_bytes"]
    assert "calibration" in f["kv_cache_scales"] and a["kv_cache_scales"] is None
    assert len(run(fp8)) == 12 and fp8.engine.runner.pool.k.dtype == torch.float8_e4m3fn
    # every K/V row the requests wrote is finite: the store saturates instead of overflowing
    assert torch.isfinite(fp8.engine.runner.pool.k.float()).all()
    # a tier never reads bytes of another format: the 8-bit pool has its own identity
    assert kv_format_identity(auto.engine.runner) == ""
    assert kv_format_identity(fp8.engine.runner).startswith("|kv=float8_e4m3fn#")
    assert run(auto) == run(auto)  # auto untouched by the other engine's existence


def test_e5m2_and_bf16_twice_the_tokens(tiny_llama: Path) -> None:
    auto = LLM(model=str(tiny_llama), dtype="bfloat16", kv_cache_memory_bytes=POOL_BYTES)
    e5m2 = LLM(model=str(tiny_llama), dtype="bfloat16", kv_cache_dtype="fp8_e5m2",
               kv_cache_memory_bytes=POOL_BYTES)
    assert e5m2.engine.info["kv_cache_tokens"] == 2 * auto.engine.info["kv_cache_tokens"]
    assert e5m2.engine.runner.pool.k.dtype == torch.float8_e5m2
    assert len(run(e5m2)) == 12


def test_scales_from_the_checkpoint_when_it_carries_them(tiny_llama: Path,
                                                         tmp_path: Path) -> None:
    model = tmp_path / "with_scales"
    shutil.copytree(tiny_llama, model)
    layers, kv_heads = 2, 2
    scales = {f"model.layers.{i}.self_attn.k_scale": torch.tensor(0.01 * (i + 1))
              for i in range(layers)}
    scales |= {f"model.layers.{i}.self_attn.v_scale": torch.tensor([0.02, 0.03])
               for i in range(layers)}
    save_file(scales, str(model / "kv_scales.safetensors"))
    llm = LLM(model=str(model), dtype="float32", kv_cache_dtype="fp8_e4m3",
              kv_cache_memory_bytes=POOL_BYTES)
    pool = llm.engine.runner.pool
    assert "checkpoint" in llm.engine.info["kv_cache_scales"]
    assert pool.k_scale is not None and pool.v_scale is not None
    assert torch.equal(pool.k_scale, torch.tensor([[0.01] * kv_heads, [0.02] * kv_heads]))
    assert torch.equal(pool.v_scale, torch.tensor([[0.02, 0.03]] * layers))
    assert len(run(llm)) == 12


def test_server_info_metrics_and_startup_log_name_the_format(tiny_llama: Path,
                                                             tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    args = ["--kv-cache-dtype", "fp8", "--kv-cache-memory-bytes", "3M"]
    with running_server(tiny_llama, log, args) as srv:
        # /metrics renders the engine's stats snapshot: wait for the first one
        wait_until_sync(lambda: "kv_cache_dtype" in srv.info()["stats"], timeout=60)
        info = srv.info()
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
    assert info["kv_cache_dtype"] == "fp8"
    assert 0 < info["kv_cache_bytes"] <= 3 * 2**20
    assert info["engine_info"]["kv_cache_storage_dtype"] == "float8_e4m3fn"
    assert 'radixserve:kv_cache_dtype_info{kv_cache_dtype="fp8"} 1.0' in metrics
    gauge = [line for line in metrics.splitlines()
             if line.startswith("radixserve:kv_cache_total_bytes ")]
    assert len(gauge) == 1 and float(gauge[0].split()[1]) == info["kv_cache_bytes"]
    tokens = info["kv_cache_tokens"]
    assert "KV cache: dtype fp8 (float8_e4m3fn, scales per (layer, KV head) from calibration" \
           in srv.output()
    assert f"{tokens} tokens, {info['kv_cache_bytes']} bytes" in srv.output()
