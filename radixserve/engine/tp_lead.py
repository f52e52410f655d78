"""TPLead: rank 0's side of tensor parallelism inside the model runner, and every rank's set-up.

Owns: start_tp (the size check before any process starts, rank 0 starting its node's workers,
every rank joining the group), and on rank 0 one step's sequence under the lock (header,
payload, then the forward with its collectives), the step count behind the per-step
collective time, turning a failed collective into TPFailedError, and the stop. Does not know:
the model's math (llama.py), the payload's layout (tp_step.py), processes (tp_ranks.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from radixserve.config import ConfigError, EngineConfig
from radixserve.engine.step_inputs import StepInputs
from radixserve.engine.tp_ranks import TPRank, TPWorkers, lead_rank
from radixserve.engine.tp_step import pack_step
from radixserve.model.arch import ModelArch
from radixserve.model.families.registry import family_of
from radixserve.model.tp_shard import TPShard
from radixserve.parallel.comm import StepKind, TPComm

logger = logging.getLogger(__name__)


class TPLead:
    def __init__(self, comm: TPComm, workers: TPWorkers) -> None:
        self.comm, self.workers = comm, workers
        self.steps = 0  # forwards run with the workers

    @property
    def pids(self) -> list[int]:
        return self.workers.pids

    def start_heartbeat(self) -> None:
        """Once every rank finished its set-up (whose collectives a PING would cross)."""
        self.workers.start_heartbeat(self.comm)

    def forward(self, inputs: StepInputs, run: Callable[[StepInputs], torch.Tensor]
                ) -> torch.Tensor:
        """Broadcast the step, then `run` rank 0's shard of it (its collectives meet the
        workers'). A dead rank or a failed collective raises TPFailedError: the engine
        cannot go on."""
        self.workers.check()
        payload = pack_step(inputs)  # (P,) int64
        try:
            with self.comm.lock:
                self.comm.send_header(StepKind.FORWARD, payload.numel())
                self.comm.send_payload(payload)
                logits = run(inputs)
                # NCCL returns when the collectives are queued: wait for them here, asking
                # the monitor meanwhile, so a dead or hung rank raises now, not in the
                # sampler's copy to the host (which nothing can interrupt).
                self.comm.wait(self.workers.check)
        except RuntimeError as err:
            raise self.workers.error_for(err) from err
        self.steps += 1
        return logits

    def stats(self) -> dict[str, Any]:
        """The figures; raises TPFailedError once a rank died (an idle engine learns it so)."""
        self.workers.check()
        seconds = self.comm.collective_seconds
        return {"tp_size": self.comm.size, "tp_steps": self.steps,
                "tp_collective_seconds": seconds,
                "tp_collective_ms_per_step": 1e3 * seconds / max(self.steps, 1)}

    def close(self) -> None:
        self.workers.close(self.comm)


def start_tp(cfg: EngineConfig, spec: ModelArch, device: torch.device, tp_rank: TPRank | None
             ) -> tuple[TPShard, TPComm, TPLead | None]:
    """This rank's shard and its place in the group (and on rank 0, `tp_rank` None, its
    TPLead). Rank 0 first checks that the ranks divide the model (ConfigError before any
    process starts), then starts its node's workers; every rank then joins the group."""
    size = cfg.tensor_parallel_size
    workers = None
    if tp_rank is None:
        if not family_of(spec.architecture).features.tensor_parallel:
            raise ConfigError(f"{spec.architecture} does not support tensor parallelism yet "
                              "(use --tensor-parallel-size 1)")
        # raises ConfigError for a size the heads (or a MoE model's experts) do not allow
        TPShard(0, size, spec, cfg.enable_expert_parallel)
        tp_rank = lead_rank(cfg)
        workers = TPWorkers(cfg, tp_rank)
        logger.info("tensor parallel: %d ranks (%d on this node), rendezvous %s", size,
                    size // cfg.nnodes, tp_rank.init_method)
    try:
        comm = TPComm(tp_rank.rank, size, device, tp_rank.init_method,
                      check_peers=None if workers is None else workers.check)
    except Exception:
        if workers is not None:
            workers.terminate()
        raise
    lead = None if workers is None else TPLead(comm, workers)
    return TPShard(tp_rank.rank, size, spec, cfg.enable_expert_parallel), comm, lead
