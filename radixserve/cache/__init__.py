"""The KV cache: the pool of pages, their allocator, and the radix tree that owns cached prefixes.

The tiers below the pool (disk, host memory, a shared directory) are in tiers/; the tree
never imports them. Does not know: requests (sched/), the model, HTTP.
"""
