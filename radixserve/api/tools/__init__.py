"""Tool calling: the request's tool fields, the chat template's view, and calls read back.

The request's tool fields (tool_fields.py), how tools reach the chat template (prompt.py), the
call formats a model writes (parsers.py, over the incremental JSON scan in json_scan.py) and
calls read back from streamed text (stream.py).
"""
