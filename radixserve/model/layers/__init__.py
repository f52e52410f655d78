"""Building blocks shared by the model families (one module per block)."""
