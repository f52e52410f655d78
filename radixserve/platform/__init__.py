"""The host the engine runs on: CPU threads and malloc settings, set once at start.

Does not know: the model, requests.
"""
