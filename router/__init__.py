"""radixserve-router: one URL in front of N `radixserve serve` replicas.

Sends each request to the replica most likely to hold its prompt's prefix in cache (an
approximate index of what it routed, or, with --kv-events, what replicas announce), without
piling load onto one replica; routes around dead ones. Entry point: `router.__main__:main`.
"""
