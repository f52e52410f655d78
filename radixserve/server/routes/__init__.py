"""The HTTP routes, one module per family.

openai.py (/v1/completions, /v1/chat/completions,
/v1/models), responses.py (/v1/responses), native.py (/generate and the operational routes),
tokenize.py (/tokenize, /detokenize), cache.py (/cache/pin*), kv_events.py (/kv_events).
"""
