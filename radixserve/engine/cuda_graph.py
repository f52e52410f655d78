"""CudaGraphRunner: decode and draft-verify forwards replayed from captured CUDA graphs.

Owns: what is captured (GraphPlan, from --cuda-graph-max-bs, --enforce-eager, the device and
the attention backend), one graph per (kind, bucket) captured into one shared memory pool,
which batches take a graph, and replaying it. Does not know: requests or the scheduler (it
reads a Batch's shape and the StepInputs the model runner built), sampling (it hands back
logits), the padding layout (graph_inputs.py), the attention math: the backend must read only
tensors and shape-fixed host fields, as TritonAttentionBackend does (its split-K decode grid
depends on the bucket size alone, its verify grid on the fixed draft length).

Uncaptured (on CPU, in tests), forward() runs the model eagerly over the same padded buffers,
so the padding path is exercised without a GPU; with `fixed_meta` it also passes the
capture-time metadata (all-padding host fields) as a replay would, which shows on CPU that
the backend's results do not depend on them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.engine.graph_inputs import (
    GraphKey,
    GraphKind,
    StaticInputs,
    bucket_for,
    describe_sizes,
    graph_batch_sizes,
)
from radixserve.types import Phase

if TYPE_CHECKING:
    from radixserve.attention.base import AttentionMetadata
    from radixserve.cache.kv_pool import KVPool
    from radixserve.config import EngineConfig
    from radixserve.engine.step_inputs import StepInputs
    from radixserve.model.families.base import CausalLM
    from radixserve.sched.req import Batch

logger = logging.getLogger(__name__)

# Verify graphs stop here: speculation pays at small batches, and a verify bucket holds
# bs * (K + 1) token rows, so large ones cost capture time for steps that rarely come.
MAX_VERIFY_BS = 64
WARMUP_RUNS = 2  # eager runs before each capture: Triton compiles, cuBLAS picks its kernels


def _capture_errors() -> tuple[type[BaseException], ...]:
    """What a bucket's capture may raise and the server survive: CUDA's and Triton's own
    (OutOfResources, CompilationError: a kernel config that does not fit this GPU)."""
    try:
        from triton.errors import TritonError
    except ImportError:  # no Triton: only torch's errors
        return (RuntimeError, AssertionError)
    return (RuntimeError, AssertionError, TritonError)


def capture_each(keys: Iterable[GraphKey], capture_one: Callable[[GraphKey], None]
                 ) -> dict[GraphKey, str]:
    """Capture every key in order; a key whose capture fails is left out (its batches run
    eagerly over the padded buffers) and the others are still captured. Returns the failures."""
    failed: dict[GraphKey, str] = {}
    errors = _capture_errors()
    for key in keys:
        try:
            capture_one(key)
        except errors as err:
            failed[key] = f"{type(err).__name__}: {err}"
            logger.warning("CUDA graphs: %s batch %d not captured, runs eagerly: %s",
                           key.kind.value, key.bs, failed[key])
    return failed


@dataclass(frozen=True)
class GraphPlan:
    """What the runner captures, decided from the flags and the device once at start-up."""

    decode_sizes: tuple[int, ...]
    verify_sizes: tuple[int, ...] = ()
    verify_stride: int = 0  # token rows per request of a verify graph (K + 1); 0: none
    reason: str = ""  # why no graph is used, when none is

    @property
    def enabled(self) -> bool:
        return bool(self.decode_sizes)

    def describe(self) -> str:
        text = f"decode batch sizes {describe_sizes(self.decode_sizes)}"
        if self.verify_sizes:
            text += (f"; verify ({self.verify_stride - 1} draft tokens) batch sizes "
                     f"{describe_sizes(self.verify_sizes)}")
        return text


def plan_graphs(cfg: EngineConfig, device: torch.device, backend_name: str) -> GraphPlan:
    """Buckets from --cuda-graph-max-bs (capped by --max-running-requests); none with
    --enforce-eager, off CUDA, or with a backend that plans attention on the host."""
    if cfg.enforce_eager:
        return GraphPlan((), reason="--enforce-eager")
    if device.type != "cuda":
        return GraphPlan((), reason=f"the device is {device.type}; graphs need CUDA")
    if backend_name != "triton":
        return GraphPlan((), reason=f"attention backend {backend_name!r} plans on the host "
                                    "(graphs need --attention-backend triton)")
    max_bs = min(cfg.cuda_graph_max_bs, cfg.max_running_requests)
    decode = graph_batch_sizes(max_bs)
    spec = cfg.speculative_config
    if spec is None:
        return GraphPlan(decode)
    verify = graph_batch_sizes(min(max_bs, MAX_VERIFY_BS))
    return GraphPlan(decode, verify, spec.num_speculative_tokens + 1)


def graph_key(plan: GraphPlan, batch: Batch) -> GraphKey | None:
    """The graph a batch takes: a DECODE batch of at most the largest bucket, whose drafts
    (if any) fit the verify graphs' length; None: run it eagerly."""
    if batch.phase is not Phase.DECODE:
        return None
    if not batch.has_drafts:
        bs = bucket_for(batch.size, plan.decode_sizes)
        return None if bs is None else GraphKey(GraphKind.DECODE, bs)
    stride = plan.verify_stride
    if not stride or any(e.num_new_tokens > stride for e in batch.entries):
        return None
    bs = bucket_for(batch.size, plan.verify_sizes)
    return None if bs is None else GraphKey(GraphKind.VERIFY, bs)


class CudaGraphRunner:
    """Pads decode (and verify) steps to a bucket and replays that bucket's graph."""

    def __init__(self, plan: GraphPlan, model: CausalLM, pool: KVPool, vocab_size: int,
                 fixed_meta: bool = False) -> None:
        assert plan.enabled, plan.reason
        self.plan, self.model, self.pool = plan, model, pool
        self.kv_scales = pool.layer_scales()  # per layer; None unless the pool is 8-bit
        self.fixed_meta = fixed_meta
        self.static: dict[GraphKind, StaticInputs] = {
            GraphKind.DECODE: StaticInputs(plan.decode_sizes[-1], 1, pool.pad_row,
                                           pool.pad_slot, pool.slot_table)}
        max_rows = plan.decode_sizes[-1]
        if plan.verify_sizes:
            self.static[GraphKind.VERIFY] = StaticInputs(
                plan.verify_sizes[-1], plan.verify_stride, pool.pad_row, pool.pad_slot,
                pool.slot_table)
            max_rows = max(max_rows, plan.verify_sizes[-1] * plan.verify_stride)
        # Every graph copies its logits here: one buffer, not one per bucket (a graph's own
        # output would stay allocated for its lifetime, bs x vocab floats per bucket).
        self.logits = torch.empty((max_rows, vocab_size), dtype=torch.float32,
                                  device=pool.slot_table.device)  # (rows, vocab)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        # Steps that went through the padded buffers (replayed, or eager when not captured).
        self.num_steps = dict.fromkeys(GraphKind, 0)
        self.failed: dict[GraphKey, str] = {}  # buckets whose capture failed: run eagerly

    def key_for(self, batch: Batch) -> GraphKey | None:
        return graph_key(self.plan, batch)

    def forward(self, key: GraphKey, inputs: StepInputs) -> torch.Tensor:
        """(N, vocab) float32 logits of inputs.logit_rows: the key's graph replayed over the
        padded step, or (not captured) an eager forward over the same buffers. The result is
        a view valid until the next forward()."""
        static = self.static[key.kind]
        keep = static.fill(inputs, key.bs)  # (N,) bucket rows to read
        graph = self.graphs.get(key)
        if graph is None:
            self._run(static, key.bs, None if self.fixed_meta else inputs.meta)
        else:
            graph.replay()
        self.num_steps[key.kind] += 1
        if key.kind is GraphKind.DECODE:  # a decode samples every request: rows 0..B-1
            return self.logits[: keep.shape[0]]
        return self.logits.index_select(0, keep)

    def _run(self, static: StaticInputs, bs: int, host: AttentionMetadata | None) -> None:
        n = bs * static.stride
        out = self.model.forward(static.input_ids[:n], static.positions[:n],
                                 static.meta(bs, host), self.pool.k, self.pool.v,
                                 static.logit_rows[:n], self.kv_scales)  # (n, vocab)
        self.logits[:n].copy_(out)

    def capture(self) -> float:
        """Capture every bucket; returns the seconds it took. CUDA only."""
        t0 = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        device = self.logits.device
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        keys = [GraphKey(GraphKind.VERIFY, s) for s in self.plan.verify_sizes]
        keys += [GraphKey(GraphKind.DECODE, s) for s in self.plan.decode_sizes]

        def capture_one(key: GraphKey) -> None:
            static = self.static[key.kind]
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self._run(static, key.bs, None)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
                    self._run(static, key.bs, None)
            finally:
                torch.cuda.synchronize(device)
            self.graphs[key] = graph

        # Most token rows first: smaller graphs reuse what the larger left in the pool.
        keys.sort(key=lambda k: -k.bs * self.static[k.kind].stride)
        self.failed = capture_each(keys, capture_one)
        torch.cuda.synchronize(device)
        return time.perf_counter() - t0


def start_graphs(cfg: EngineConfig, device: torch.device, backend_name: str,
                 model: CausalLM, pool: KVPool, vocab_size: int) -> CudaGraphRunner | None:
    """The runner with its graphs captured, or None (eager), saying so once in the log."""
    plan = plan_graphs(cfg, device, backend_name)
    if not plan.enabled:
        logger.info("CUDA graphs: not used (%s)", plan.reason)
        return None
    runner = CudaGraphRunner(plan, model, pool, vocab_size)
    try:
        seconds = runner.capture()
    except (RuntimeError, AssertionError) as err:  # a forward that is not capturable
        logger.warning("CUDA graphs: capture failed, running eagerly: %s", err)
        return None
    logger.info("CUDA graphs: captured %d graphs in %.1f s (%s)", len(runner.graphs), seconds,
                plan.describe())
    return runner
