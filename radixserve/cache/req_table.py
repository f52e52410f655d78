"""ReqTable: rows of the slot table handed to running requests, and writes into them.

Owns: which table rows are free, and writing (row, position) -> slot entries into the KV
pool's slot table. Only the scheduler calls it. Does not know: attention, the radix tree.
"""

from __future__ import annotations

import torch


class ReqTable:
    def __init__(self, slot_table: torch.Tensor) -> None:
        self.table = slot_table  # (max_reqs, max_model_len) int32
        self._free_rows = list(range(slot_table.shape[0] - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def acquire(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def release(self, row: int) -> None:
        assert row not in self._free_rows, f"row {row} released twice"
        self._free_rows.append(row)

    def write_row(self, row: int, start: int, slots: list[int]) -> None:
        """Positions [start, start + len(slots)) of `row` now live in `slots`."""
        if slots:
            self.table[row, start : start + len(slots)] = torch.tensor(
                slots, dtype=self.table.dtype).to(self.table.device, non_blocking=True)

    def write_entries(self, rows: list[int], positions: list[int], slots: list[int]) -> None:
        """One entry per request (the decode step's new token), in one scatter."""
        dev = self.table.device
        self.table[torch.tensor(rows, device=dev), torch.tensor(positions, device=dev)] = (
            torch.tensor(slots, dtype=self.table.dtype, device=dev)
        )
