"""Model families: one short module per family composing model/layers/, and the registry
mapping a config's architecture to its family.

Does not know: requests, the scheduler, sampling.
"""
