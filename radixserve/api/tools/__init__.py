"""Tool calling: the request's tool fields (spec.py), how tools reach the chat template
(prompt.py), the call formats a model writes (parsers.py, over the incremental JSON scan in
json_scan.py) and calls read back from streamed text (stream.py).
"""
