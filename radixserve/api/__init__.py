"""The OpenAI and native protocol: what a request may say and what it becomes.

Free of HTTP and of torch.

Owns: parsing and validating request bodies (protocol.py, responses.py, fields.py,
chat_messages.py), output constraints (constraints/), tools (tools/), the length/range/seed
rules (lengths.py), turning a request into its choices (jobs.py), and the aiohttp-free parts
of API keys and rate limits (keys.py, ratelimit.py). Imported by the aiohttp server
(radixserve/server), the offline LLM (radixserve/llm.py), the scheduler's request rules
and the router. Does not know: aiohttp, torch, the engine (import-linter enforces this).
"""
