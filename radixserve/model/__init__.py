"""The model: config.json parsed, weights loaded, and the Llama-family forward pass.

Does not know: requests, scheduling, HTTP; attention over the pool is attention/'s.
"""
