"""Test doubles, in one place: a fake engine and fake replicas.

A fake engine (fake_engine.py: the Engine contract without a
model, and a transport that runs it on the caller's event loop) and fake replicas for the
router (fake_replica.py: the HTTP surface of `radixserve serve` with a toy prefix cache).
Used by tests and bench only; nothing in radixserve's serving path imports this package.
"""
