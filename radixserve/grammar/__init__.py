"""Grammar-constrained decoding: constraint -> llguidance grammar, compile, per-sequence matchers.

Submodules: spec (torch-free: Constraint -> grammar text), validate (torch-free: 400 before
queueing), backend (matchers over a tokenizer), compiler (compile off the step loop, cached),
mask (the batch bitmask, applied to logits). This package file imports nothing, so the API
process can import `radixserve.grammar.validate` without pulling torch.
"""
