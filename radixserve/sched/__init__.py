"""Scheduling: requests (req.py), the scheduler (their only mutator), its memory manager
(pages between the allocator, the radix tree and requests) and its ordering policy.
Engine-process side; pure Python over token ids and slot numbers, no tensors.
"""
