"""Output constraints as requests spell them: OpenAI's `response_format` (response_format.py),
the vLLM and SGLang extra fields of the OpenAI routes (extra.py), the native /generate fields
(native.py), and the memo of constraints that already compiled (check.py).
"""
