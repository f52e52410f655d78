"""Scheduling: requests and batches, the scheduler (their only mutator) and its helpers.

Requests and batches (req.py), the scheduler, its helpers (prefill.py, decode.py,
preemption.py, outputs.py: which requests one step runs and what its tokens do; the scheduler
alone writes a request's status), its memory manager (pages between the allocator, the radix
tree and requests; free slot-table rows), its ordering policy and pinned prefixes.
Engine-process side; pure Python over token ids, slot numbers and row numbers, no tensors
(the model runner writes the slot table from each batch).
"""
