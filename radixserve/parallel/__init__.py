"""Tensor parallelism's collectives (comm.py); the shards' math lives in model/tp_shard.py."""
