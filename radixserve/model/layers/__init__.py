"""The building blocks every model family composes: linear, norm, rotary, attention, MLP,
embeddings, each picking its kernel by device inside the layer.

Does not know: any family's config or checkpoint names (families/), requests, the scheduler.
"""
