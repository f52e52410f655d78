"""Routing: from a request's prompt to the worker that holds most of its prefix, by policy.

Does not know: HTTP forwarding (proxy/), discovery (discovery/).
"""
