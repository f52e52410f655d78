"""Which GPU a tensor-parallel rank runs on, bound before it touches CUDA.

Owns: the check that a node has a GPU for each of its ranks (a clear ConfigError instead of
CUDA's "invalid device ordinal" deep in a worker) and binding the rank's process to its GPU
(torch.cuda.set_device): Triton launches on the current device, and a process that never
binds opens a context on GPU 0 whatever tensors it holds, which rank 0's pool sizing did not
count. Does not know: models, collectives, processes.
"""

from __future__ import annotations

import torch

from radixserve.config import ConfigError


def bind_rank_device(device: torch.device, ranks_per_node: int) -> None:
    """Make `device` (cuda:local_rank) this process's current device; ConfigError when the
    node has fewer GPUs than ranks. A CPU device needs nothing."""
    if device.type != "cuda":
        return
    count = torch.cuda.device_count()
    if ranks_per_node > count:
        raise ConfigError(
            f"tensor parallelism needs {ranks_per_node} GPUs on this node, found {count}: "
            f"lower --tensor-parallel-size (or spread it with --nnodes)")
    torch.cuda.set_device(device)
