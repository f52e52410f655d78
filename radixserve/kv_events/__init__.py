"""KV-cache events: the block hash chain a replica publishes, over HTTP SSE or vLLM's ZMQ.

Does not know: the tree's internals (it reads CacheEvents), routing (the router follows them).
"""
