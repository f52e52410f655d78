"""Fleet controls: per-key limits across routers, session affinity, canary groups.

Does not know: how a request is forwarded (proxy/) or scored (routing/).
"""
