"""`radixserve serve` flags -> frozen configs; bad settings -> a clean message, exit 2."""

from __future__ import annotations

import pytest

from radixserve.cli import build_config, build_parser, main
from radixserve.config import EngineConfig, ServerConfig


def config(argv: list[str], env: dict[str, str] | None = None) -> ServerConfig:
    return build_config(build_parser().parse_args(["serve", *argv]), env or {})


def test_unset_flags_keep_config_defaults() -> None:
    cfg = config([])
    assert cfg == ServerConfig(engine=EngineConfig())


def test_flags_reach_the_configs() -> None:
    cfg = config([
        "--model", "/m", "--host", "0.0.0.0", "--port", "8001", "--api-key", "a",
        "--api-key", "b", "--served-model-name", "mine", "--max-model-len", "4096",
        "--dtype", "bfloat16", "--kv-cache-tokens", "10000", "--page-size", "16",
        "--chunked-prefill-size", "512", "--max-prefill-tokens", "4096",
        "--max-running-requests", "8", "--schedule-policy", "fcfs", "--disable-radix-cache",
        "--attention-backend", "torch", "--seed", "3", "--num-threads", "2",
        "--enable-kv-events", "--shared-cache", "--max-tokens-cap", "100",
        "--max-input-tokens", "2000", "--max-concurrent-per-key", "4", "--max-queue", "64",
    ], env={"RADIXSERVE_API_KEY": "c"})
    e = cfg.engine
    assert (e.model, e.max_model_len, e.dtype, e.kv_cache_tokens, e.page_size) == (
        "/m", 4096, "bfloat16", 10000, 16)
    assert (e.chunked_prefill_size, e.max_prefill_tokens, e.max_running_requests) == (512, 4096, 8)
    assert (e.schedule_policy, e.disable_radix_cache, e.attention_backend) == ("fcfs", True, "torch")
    assert (e.seed, e.num_threads, e.enable_kv_events) == (3, 2, True)
    assert (cfg.host, cfg.port, cfg.api_keys, cfg.served_model_name) == (
        "0.0.0.0", 8001, ("a", "b", "c"), "mine")
    assert (cfg.shared_cache, cfg.max_tokens_cap, cfg.max_input_tokens) == (True, 100, 2000)
    assert (cfg.max_concurrent_per_key, cfg.max_queue) == (4, 64)


@pytest.mark.parametrize(("argv", "words"), [
    (["--page-size", "0"], "page_size"),
    (["--dtype", "int3"], "dtype"),
    (["--port", "70000"], "port"),
    (["--max-queue", "0"], "max_queue"),
    (["--reasoning-parser", "qwen"], "unknown reasoning parser 'qwen'; supported: qwen3, "
                                     "deepseek_r1"),
])
def test_config_errors_exit_cleanly(argv: list[str], words: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("radixserve: error:") and words in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_reasoning_parser_flag(name: str) -> None:
    assert config(["--reasoning-parser", name]).reasoning_parser == name
    assert config([]).reasoning_parser is None  # off unless asked


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0 and "--max-concurrent-per-key" in capsys.readouterr().out


def test_no_hidden_engine_factory_flag() -> None:
    """The engine process only ever builds the real Engine from the CLI: no flag imports
    arbitrary code into it."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--engine-factory", "os:system"])
    assert exc.value.code == 2


def test_cache_control_flags() -> None:
    cfg = config(["--eviction-policy", "slru", "--tenant-cache-quota", "0.25",
                  "--max-pinned-tokens", "4096", "--admin-key", "root", "--api-key", "k"])
    e = cfg.engine
    assert (e.eviction_policy, e.tenant_cache_quota, e.max_pinned_tokens) == ("slru", 0.25, 4096)
    assert cfg.admin_key == "root" and cfg.api_keys == ("k",)
    assert main(["serve", "--eviction-policy", "lfu"]) == 2
    assert main(["serve", "--tenant-cache-quota", "1.5"]) == 2


@pytest.mark.parametrize("argv", [["--tensor-parallel-size", "2"], ["-tp", "2"],
                                  ["--tp-size", "2"]])
def test_tensor_parallel_flags(argv: list[str]) -> None:
    e = config(argv).engine
    assert (e.tensor_parallel_size, e.nnodes, e.node_rank, e.dist_init_addr) == (2, 1, 0, None)


def test_multi_node_flags() -> None:
    e = config(["--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
                "--dist-init-addr", "10.0.0.5:29500"]).engine
    assert (e.tensor_parallel_size, e.nnodes, e.node_rank, e.dist_init_addr) == (
        4, 2, 1, "10.0.0.5:29500")


@pytest.mark.parametrize(("argv", "words"), [
    (["--tensor-parallel-size", "0"], "tensor_parallel_size"),
    (["-tp", "2", "--nnodes", "2"], "--dist-init-addr"),
    (["-tp", "2", "--kv-cache-dtype", "fp8"], "kv_cache_dtype"),
])
def test_tensor_parallel_config_errors_exit_cleanly(argv: list[str], words: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("radixserve: error:") and words in err
