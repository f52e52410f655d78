"""Expert parallelism and tensor parallelism of MoE models in the real engine (gloo on CPU,
fp32): EP 2 and TP 2 give TP 1's greedy tokens; bad splits are refused before any rank
starts, with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve import LLM, SamplingParams
from radixserve.cli import build_config, build_parser
from radixserve.config import ConfigError
from tests.engine.test_engine_cache import run_checked, shared_prefix_prompts
from tests.model.test_moe_parity import tiny
from tests.server_proc import running_server

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _tokens(model: Path, tp: int, ep: bool) -> list[list[int]]:
    llm = LLM(model=str(model), dtype="float32", kv_cache_tokens=4096,
              tensor_parallel_size=tp, enable_expert_parallel=ep, chunked_prefill_size=16)
    try:
        moe = llm.engine.info["moe"]
        assert moe["num_experts"] == 8 and moe["expert_parallel"] == (ep and tp > 1)
        assert moe["experts_per_rank"] == (8 // tp if ep else 8)
        return run_checked(llm, shared_prefix_prompts(2, 2, 30, 6), PARAMS)
    finally:
        llm.close()


@pytest.mark.parametrize(("family", "ep"), [("qwen2_moe", True), ("mixtral", True),
                                            ("qwen3_moe", False)])
def test_parallel_moe_equals_one_rank(family: str, ep: bool, tmp_path: Path) -> None:
    """qwen2_moe: its shared expert sliced, a dense layer (decoder_sparse_step 2) TP-split;
    EP: 4 of the 8 experts whole on each rank; qwen3_moe TP: each expert's width halved."""
    model = tiny(tmp_path, family, layout="packed" if family == "mixtral" else "per_expert")
    assert _tokens(model, 2, ep) == _tokens(model, 1, False)


def test_indivisible_experts_are_refused_before_ranks_start(tmp_path: Path) -> None:
    model = tiny(tmp_path, "mixtral", num_experts=6)
    with pytest.raises(ConfigError, match="6 experts are not divisible by 4"):
        LLM(model=str(model), dtype="float32", tensor_parallel_size=4,
            enable_expert_parallel=True)


def test_olmoe_tensor_parallel_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="OlmoeForCausalLM does not support tensor"):
        LLM(model=str(tiny(tmp_path, "olmoe")), dtype="float32", tensor_parallel_size=2)


def test_server_info_lists_experts_under_the_flags_as_written(tmp_path: Path) -> None:
    model = tiny(tmp_path, "qwen2_moe")
    args = ["--tensor-parallel-size", "2", "--enable-expert-parallel"]
    with running_server(model, tmp_path / "serve.log", args) as srv:
        info = srv.info()
    assert info["moe"] == {"num_experts": 8, "top_k": 2, "expert_intermediate_size": 32,
                           "shared_expert_intermediate_size": 48, "renormalize_top_k": False,
                           "num_sparse_layers": 1, "expert_parallel": True,
                           "experts_per_rank": 4}
    assert info["engine_info"]["architecture"] == "Qwen2MoeForCausalLM"


def test_cli_flag() -> None:
    args = build_parser().parse_args(["serve", "--model", "m", "--tensor-parallel-size", "2",
                                      "--enable-expert-parallel"])
    engine = build_config(args, {}).engine
    assert engine.enable_expert_parallel and engine.tensor_parallel_size == 2
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert not build_config(args, {}).engine.enable_expert_parallel
