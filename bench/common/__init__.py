"""What the benchmarks share: workloads, the HTTP client, metrics, plots, CPU accounting.

Does not know: any one benchmark's question (the entry points in bench/ ask those).
"""
