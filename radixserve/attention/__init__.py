"""Attention backends behind one seam (base.py): plain torch, native CPU kernels, Triton.

Owns: how a batch's queries attend over the paged KV pool. Does not know: requests, the tree.
"""
