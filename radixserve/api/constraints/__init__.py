"""Output constraints as requests spell them, in each API's own fields.

OpenAI's `response_format` (response_format.py), the vLLM and SGLang extra fields of the
OpenAI routes (extra.py), the native /generate fields (native_fields.py), and the memo of
constraints that already compiled (check.py).
"""
