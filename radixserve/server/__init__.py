"""The aiohttp API server: the app, its process, the routes, access control.

The app (app.py), its process loop (serve.py), the routes
(routes/), access control and HTTP guards (access/), and what they share: the per-app state
(app_state.py), prompt encoding (prompts.py), one choice's stream (choice_stream.py), SSE,
errors, metrics, the detokenizer and the stats log. The protocol itself (parsing, tools,
constraints, jobs) is radixserve/api's. Never imports torch or the engine side.
"""
