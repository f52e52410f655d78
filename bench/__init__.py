"""Benchmarks: each `python -m bench.NAME` is an entry point; support modules are in common/.

Figures are ratios measured side by side in one run (bench/README.md). Not shipped in the wheel.
"""
