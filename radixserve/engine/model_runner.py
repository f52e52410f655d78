"""ModelRunner: loads the model, sizes the KV pool, and maps a Batch to sampled token ids.

Owns: device/dtype choice, the weights, the KV pool tensors (their contents), the slot
table's contents (it is the table's only writer: each batch entry says which positions of
its request's slots to write into its row), the attention backend, and the sampler. Reads
Req (token ids, slots, num_computed_tokens, table_row) but never writes it: the scheduler is
the only mutator of requests.
Does not know: the radix tree, queues, HTTP.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from radixserve.attention.base import AttentionBackend, AttentionMetadata
from radixserve.attention.cpu_kernels import load_paged_decode, load_prefill_attention
from radixserve.attention.kv_quant import is_fp8, storage_dtype
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.attention.varlen import token_offsets
from radixserve.cache.kv_pool import KVPool, KVPoolSize, bytes_per_token
from radixserve.config import ConfigError, EngineConfig
from radixserve.engine.cuda_graph import CudaGraphRunner, start_graphs
from radixserve.engine.decode_groups import DecodeFixed, shared_prefixes
from radixserve.engine.lora_step import lora_batch, lora_slots
from radixserve.engine.sampler import Sampler, SampleResult
from radixserve.engine.step_inputs import StepInputs, back_writes, write_slot_table
from radixserve.engine.tp_lead import TPLead, start_tp
from radixserve.engine.tp_ranks import TPRank
from radixserve.model.arch import ModelArch
from radixserve.model.auto_dtype import choose_auto_dtype, cpu_flags
from radixserve.model.families.registry import build_model, family_of, read_model_spec
from radixserve.model.lora_delta import StepLoRA
from radixserve.model.quantization.config import read_quant_config, resolve_quantization
from radixserve.model.weight_memory import WeightPages, place_weights
from radixserve.model.weights import load_weights
from radixserve.model_source import ResolvedModel, resolve_model
from radixserve.parallel.comm import TPComm
from radixserve.parallel.devices import bind_rank_device
from radixserve.platform.cpu_isa import CpuIsaError, TierChoice, choose_tier
from radixserve.platform.cpu_malloc import keep_freed_memory
from radixserve.platform.cpu_threads import choose_num_threads
from radixserve.platform.kernels import kernel_tier_line
from radixserve.sched.req import Batch
from radixserve.types import Phase

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 1 << 30  # default on CPU; --kv-cache-tokens overrides
GPU_MEMORY_FRACTION = 0.85


def _cpu_tier() -> TierChoice:
    try:
        return choose_tier()
    except CpuIsaError as e:
        raise ConfigError(str(e)) from None


def resolve_device_dtype(cfg: EngineConfig, local_rank: int = 0
                         ) -> tuple[torch.device, torch.dtype]:
    """`local_rank`: a tensor-parallel rank's index on its node (its GPU)."""
    if cfg.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
    if device.type == "cuda" and cfg.tensor_parallel_size > 1:
        device = torch.device("cuda", local_rank)
        bind_rank_device(device, cfg.tensor_parallel_size // cfg.nnodes)
    # A bad RADIXSERVE_CPU_ISA fails here, before the weights load; a cap below the CPU's
    # best also caps what dtype auto picks (an AVX2 cap runs as an AVX2 machine: fp32).
    tier = _cpu_tier() if device.type == "cpu" else None
    if cfg.dtype == "auto":
        choice = choose_auto_dtype(device, cpu_flags(), tier=tier)
        logger.info("%s", choice.describe())
        return device, choice.dtype
    return device, getattr(torch, cfg.dtype)


def _choose_backend(name: str, device: torch.device) -> tuple[str, AttentionBackend]:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from radixserve.attention.triton_backend import TritonAttentionBackend

        return name, TritonAttentionBackend()
    # On CPU, decode steps go through the native paged kernel and prefill chunks through the
    # native causal kernel (one extension, built once, cached; the torch path stays where it
    # cannot be built).
    if device.type != "cpu":
        return name, TorchAttentionBackend()
    return name, TorchAttentionBackend(load_paged_decode(), load_prefill_attention())


class ModelRunner:
    """`tp_rank`: on a tensor-parallel worker (tp_worker.py), which rank this is; None on rank
    0 (the engine's runner), which starts the workers of its node when the config asks for
    tensor parallelism, then loads its own shard like each of them."""

    def __init__(self, cfg: EngineConfig, show_progress: bool = True,
                 tp_rank: TPRank | None = None) -> None:
        tp_size = cfg.tensor_parallel_size
        self.device, self.dtype = resolve_device_dtype(cfg, tp_rank.local_rank if tp_rank else 0)
        if cfg.num_threads or self.device.type == "cpu":
            threads = choose_num_threads(cfg.num_threads, tp_size)
            torch.set_num_threads(threads.num_threads)
            logger.info("torch threads: %d (%s)", threads.num_threads, threads.reason)
        if self.device.type == "cpu" and keep_freed_memory():
            logger.info("malloc: freed memory kept in the heap (RADIXSERVE_DEFAULT_MALLOC=1: off)")
        self.resolved: ResolvedModel = resolve_model(cfg.model)
        self.spec: ModelArch = read_model_spec(self.resolved.hf_dir)
        self.max_model_len = min(cfg.max_model_len or self.spec.max_position_embeddings,
                                 self.spec.max_position_embeddings)
        if cfg.max_model_len and cfg.max_model_len > self.spec.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {cfg.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.spec.max_position_embeddings}"
            )
        self.tp: TPComm | None = None
        self.tp_lead: TPLead | None = None  # rank 0's: the step broadcast, its workers
        shard = None
        if tp_size > 1:
            shard, self.tp, self.tp_lead = start_tp(cfg, self.spec, self.device, tp_rank)
        self.is_lead = tp_rank is None or tp_rank.rank == 0
        self.quant_config = read_quant_config(self.resolved.hf_dir)
        # The flag's load-time quantization (int8 / fp8) of a float checkpoint, or None for a
        # checkpoint whose weights come quantized (a contradicting flag is a load error).
        online_quant = resolve_quantization(cfg.quantization, self.quant_config)
        self.quantization = online_quant or (None if self.quant_config is None
                                             else self.quant_config.method)
        weights = load_weights(self.resolved.hf_dir, self.spec, self.dtype, self.device,
                               show_progress, shard,
                               family_of(self.spec.architecture).weight_names, self.quant_config)
        self.backend_name, backend = _choose_backend(cfg.attention_backend, self.device)
        # which native tier runs (its build and any fallback happened just above)
        self.cpu_kernels = kernel_tier_line() if self.device.type == "cpu" else None
        if self.cpu_kernels is not None:
            logger.info("CPU kernels: %s", self.cpu_kernels)
        model_spec = self.spec if shard is None else shard.local_arch()  # this rank's heads
        # --enable-lora: every projection carries the hook that adds a step's adapter deltas
        self.lora_hook = None if cfg.lora is None else StepLoRA()
        self.model = build_model(model_spec, weights, backend, self.max_model_len,
                                 online_quant, tp=self.tp, shard=shard,
                                 checkpoint_quant=self.quant_config, lora=self.lora_hook)
        # CPU: the weights (prepacked by now, not yet read) into 2 MB pages: a decode step
        # streams them all, and 4 KB pages cost it a TLB miss per page (weight_memory.py)
        self.weight_pages: WeightPages | None = (
            place_weights(self.model) if self.device.type == "cpu" else None)
        if self.weight_pages is not None:
            logger.info("weight pages: %s", self.weight_pages.describe())
        layer_bytes, head_bytes = self.model.linear_weight_bytes()
        logger.info("linear weights: %.1f MB in the layers + %.1f MB LM head (%s%s)",
                    layer_bytes / 1e6, head_bytes / 1e6, str(self.dtype).removeprefix("torch."),
                    f", {self.quantization}" if self.quantization else "")
        # CUDA: the adapters of a step in device stacks for the Triton kernels (CPU: GEMMs).
        self.lora_slots = lora_slots(cfg, self.spec, self.dtype, self.device)
        self.kv_cache_dtype = cfg.kv_cache_dtype
        kv_dtype = storage_dtype(cfg.kv_cache_dtype, self.dtype)
        self.pool = KVPool(self._pool_size(cfg, kv_dtype, model_spec.num_kv_heads),
                           self.spec.num_layers, model_spec.num_kv_heads, self.spec.head_dim,
                           cfg.max_running_requests, self.max_model_len, kv_dtype, self.device)
        self.kv_scale_source = None
        self.kv_scales = self.pool.layer_scales()
        self.graphs: CudaGraphRunner | None = None
        if not self.is_lead:
            return  # a worker: no tokenizer, sampler or graphs (rank 0 samples)
        from radixserve.tokenizer import eos_token_ids, load_tokenizer

        tokenizer = load_tokenizer(self.resolved.hf_dir)
        self.eos_token_ids = eos_token_ids(tokenizer, self.spec.eos_token_id)
        if is_fp8(kv_dtype):
            from radixserve.engine.kv_calibration import set_pool_scales

            self.kv_scale_source = set_pool_scales(self.pool, self.model, tokenizer,
                                                   self.resolved.hf_dir, self.max_model_len)
        self._log_pool()
        self.kv_scales = self.pool.layer_scales()
        self.sampler = Sampler(self.eos_token_ids, cfg.seed, self.device)
        self._decode_fixed: DecodeFixed | None = None  # of the last plain decode step
        # Last: the graphs read the pool's tensors and replay the model as it now is.
        if self.tp is not None:
            logger.info("CUDA graphs: not used (tensor parallelism runs eagerly)")
        else:
            self.graphs = start_graphs(cfg, self.device, self.backend_name, self.model,
                                       self.pool, self.spec.vocab_size)
        if self.tp_lead is not None:
            self.tp_lead.start_heartbeat()

    def _log_pool(self) -> None:
        size, pool = self.pool.size, self.pool
        how = f", scales per (layer, KV head) from {self.kv_scale_source}" if (
            self.kv_scale_source) else ""
        logger.info("KV cache: dtype %s (%s%s), %d tokens, %d bytes (%.2f GiB)",
                    self.kv_cache_dtype, str(pool.dtype).removeprefix("torch."), how,
                    size.num_slots, pool.num_bytes, pool.num_bytes / 2**30)

    def _pool_size(self, cfg: EngineConfig, kv_dtype: torch.dtype, num_kv_heads: int
                   ) -> KVPoolSize:
        """`num_kv_heads`: this rank's; under tensor parallelism every rank takes the smallest
        page count any rank can hold, so that a page id is the same slot on every rank."""
        per_token = bytes_per_token(self.spec.num_layers, num_kv_heads, self.spec.head_dim,
                                    kv_dtype)
        if cfg.kv_cache_tokens is not None:
            tokens = cfg.kv_cache_tokens
        elif cfg.kv_cache_memory_bytes is not None:
            tokens = cfg.kv_cache_memory_bytes // per_token
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            tokens = int(free * GPU_MEMORY_FRACTION) // per_token
        else:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
            tokens = min(CPU_KV_BUDGET_BYTES, avail // 4) // per_token
        num_pages = tokens // cfg.page_size
        if self.tp is not None:
            num_pages = self.tp.min_int(num_pages)
        if num_pages * cfg.page_size < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {num_pages * cfg.page_size} tokens, fewer than one request of "
                f"max_model_len {self.max_model_len}; the largest context that fits is "
                f"{num_pages * cfg.page_size} tokens: lower --max-model-len or raise "
                f"--kv-cache-tokens / --kv-cache-memory-bytes"
            )
        size = KVPoolSize(num_pages, cfg.page_size)
        logger.debug("KV cache size: %d tokens (%.2f GiB, %s)", size.num_slots,
                    size.num_slots * per_token / 2**30, kv_dtype)
        logger.debug("Maximum concurrency for %d tokens per request: %.2fx", self.max_model_len,
                    size.num_slots / self.max_model_len)
        return size

    def prepare(self, batch: Batch, placeholders: bool = False) -> StepInputs:
        """Flatten the batch into ragged inputs and write its slots into the slot table.
        `placeholders`: a plain decode whose input ids the device fills (overlap.py)."""
        if batch.rows is not None:
            return self._prepare_decode(batch, placeholders)
        ids: list[int] = []
        positions: list[int] = []
        out_slots: list[int] = []
        logit_rows: list[int] = []
        back: list[tuple[int, int, list[int]]] = []  # (row, first position, slots) to rewrite
        reqs = batch.reqs
        prefix_lens = [r.num_computed_tokens for r in reqs]
        extend_lens = batch.new_token_counts
        for e in batch.entries:
            req, n = e.req, e.num_new_tokens
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            assert req.table_row >= 0 and n > 0 and len(req.slots) >= end
            # A draft follows the request's last token; logits at every one of its positions.
            ids += req.token_ids[start:end] if not e.draft else [req.token_ids[start], *e.draft]
            positions += range(start, end)
            out_slots += req.slots[start:end]
            if e.draft:
                logit_rows += range(len(ids) - n, len(ids))
            elif e.sample:
                logit_rows.append(len(ids) - 1)
            if e.table_from < start:
                back.append((req.table_row, e.table_from, req.slots[e.table_from : start]))
        dev = self.device
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
        cu = token_offsets(extend_lens)
        rows = [r.table_row for r in reqs]
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        extend_t = torch.tensor(extend_lens, dtype=torch.int32, device=dev)
        positions_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        out_slots_t = torch.tensor(out_slots, dtype=torch.int64, device=dev)
        shared, own_start = shared_prefixes(
            reqs, self.model.backend.reads_shared_prefixes, self.device)
        # Verifying drafts is a prefill over a cached prefix, not a one-token decode.
        phase = Phase.PREFILL if batch.phase is Phase.DECODE and batch.has_drafts else batch.phase
        meta = AttentionMetadata(
            phase=phase,
            slot_table=self.pool.slot_table,
            rows=rows_t,
            prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=dev),
            extend_lens=extend_t,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            cu_extend=torch.tensor(cu, dtype=torch.int32, device=dev),
            out_slots=out_slots_t,
            prefix_lens_cpu=tuple(prefix_lens),
            extend_lens_cpu=tuple(extend_lens),
            max_seq_len=max(seq_lens),
            max_extend_len=max(extend_lens),
            rows_cpu=tuple(rows),
            shared=tuple(shared),
            own_start=torch.tensor(own_start, dtype=torch.int64, device=dev),
            own_start_cpu=tuple(own_start),
        )
        table_back = back_writes(back, dev)
        write_slot_table(self.pool.slot_table, meta, positions_t, table_back)
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=positions_t,
            meta=meta,
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64, device=dev),
            table_back=table_back,
            lora=lora_batch(reqs, extend_lens, len(ids), False, self.lora_slots),
        )

    def _prepare_decode(self, batch: Batch, placeholders: bool = False) -> StepInputs:
        """A plain decode step: one token per running request. What stays fixed while the
        running set does (rows, offsets, shared prefixes) is built once per set (DecodeRows)
        and kept; a step builds only its token ids, positions and new slots."""
        rows, pos = batch.rows, batch.positions
        assert rows is not None and pos is not None
        fixed = self._decode_fixed
        if fixed is None or fixed.rows is not rows:
            fixed = self._decode_fixed = DecodeFixed.build(
                rows, self.model.backend.reads_shared_prefixes, self.device)
        reqs = rows.reqs
        dev = self.device
        # Overlap scheduling: every token is still in flight (the step before sampled it on
        # the device); the ids are filled there (overlap.resolve_pending).
        ids = [] if placeholders else [r.token_ids[p] for r, p in zip(reqs, pos, strict=True)]
        slots = [r.slots[p] for r, p in zip(reqs, pos, strict=True)]
        back = [(reqs[i].table_row, first, reqs[i].slots[first : pos[i]])
                for i, first in batch.lagging.items()]
        positions_t = torch.tensor(pos, dtype=torch.int64, device=dev)  # (B,)
        out_slots_t = torch.tensor(slots, dtype=torch.int64, device=dev)  # (B,)
        prefix_t = positions_t.to(torch.int32)  # (B,)
        max_pos = max(pos)
        meta = AttentionMetadata(
            phase=Phase.DECODE, slot_table=self.pool.slot_table, rows=fixed.rows_t,
            prefix_lens=prefix_t, extend_lens=fixed.ones, seq_lens=prefix_t + 1,
            cu_extend=fixed.cu, out_slots=out_slots_t, prefix_lens_cpu=tuple(pos),
            extend_lens_cpu=fixed.ones_cpu, max_seq_len=max_pos + 1, max_extend_len=1,
            rows_cpu=fixed.rows_cpu, shared=fixed.shared, own_start=fixed.own_start,
            own_start_cpu=fixed.own_start_cpu)
        table_back = back_writes(back, dev)
        write_slot_table(self.pool.slot_table, meta, positions_t, table_back)
        ids_t = (torch.empty(len(pos), dtype=torch.int64, device=dev) if placeholders
                 else torch.tensor(ids, dtype=torch.int64, device=dev))  # (B,)
        lora = None if fixed.base_only else lora_batch(reqs, fixed.ones_cpu, len(pos), True,
                                                       self.lora_slots)
        return StepInputs(ids_t, positions_t, meta, fixed.arange, table_back, lora)

    def run(self, batch: Batch) -> SampleResult:
        """Forward the batch; sample one token for every entry with `sample` set, in order (an
        entry with a draft: one per position it computes, its verification)."""
        inputs = self.prepare(batch)
        logits = self.logits(batch, inputs)
        if batch.rows is not None:  # a plain decode step: one token per running request
            return self.sampler.sample(logits, batch.rows.reqs,
                                       plain=batch.rows.plain_sampling)
        picked = [e for e in batch.entries if e.sample]
        if not picked:
            return SampleResult([], [])
        drafts = [e.draft for e in picked] if batch.has_drafts else None
        return self.sampler.sample(logits, [e.req for e in picked], drafts)

    def logits(self, batch: Batch, inputs: StepInputs) -> torch.Tensor:  # (N, vocab) float32
        """The forward of prepared inputs: the tensor-parallel group, a CUDA graph or eager.
        Steps with adapter rows run eagerly (the graphs hold the base model's forward)."""
        key = (self.graphs.key_for(batch) if self.graphs is not None and inputs.lora is None
               else None)
        if self.tp_lead is not None:
            return self.tp_lead.forward(inputs, self.forward_eager)
        if self.graphs is not None and key is not None:
            return self.graphs.forward(key, inputs)
        return self.forward_eager(inputs)

    def forward_eager(self, inputs: StepInputs) -> torch.Tensor:  # (N, vocab) float32
        """The model over the pool, eagerly (on a tensor-parallel worker: its shard)."""
        if self.lora_hook is None:
            return self.model.forward(inputs.input_ids, inputs.positions, inputs.meta,
                                      self.pool.k, self.pool.v, inputs.logit_rows,
                                      self.kv_scales)
        with self.lora_hook.using(inputs.lora):
            return self.model.forward(inputs.input_ids, inputs.positions, inputs.meta,
                                      self.pool.k, self.pool.v, inputs.logit_rows,
                                      self.kv_scales)

    def tp_stats(self) -> dict[str, Any]:
        """Tensor parallelism's figures (empty without it); raises TPFailedError once a rank
        died."""
        return {} if self.tp_lead is None else self.tp_lead.stats()

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without them)."""
        if self.tp_lead is not None:
            self.tp_lead.close()
            self.tp_lead = None

