"""Proxying: forwarding a request to a worker and streaming the answer, resumed on failure.

Does not know: which worker is best (routing/), the fleet controls (fleet/).
"""
