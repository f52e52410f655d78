"""The host the engine runs on: CPU threads, malloc settings, and the native kernels per CPU tier.

Does not know: the model, requests.
"""
