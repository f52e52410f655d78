"""bench.fused_kernels' correctness pass: fused and unfused agree at the Llama-1B shape."""

from __future__ import annotations

import pytest
import torch

from bench.fused_kernels import run


def test_interpreter_pass_agrees_with_the_unfused_ops(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    diffs = run([2], torch.float32, device, 3)
    assert len(diffs) == 3 and max(diffs) <= 1e-5
    table = capsys.readouterr().out
    assert all(op in table for op in ("add+rmsnorm", "rope+store", "silu*up"))
