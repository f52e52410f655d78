"""Speculative decoding without a draft model: draft sources, verification and adaptivity."""
