"""Who may use the server and how much of it: keys, admission limits, HTTP guards.

Authentication (auth.py), admission limits
(limits.py), the auth and rate-limit-header middleware (middleware.py), and the HTTP guards:
request deadlines (deadline.py), body caps (body.py), send timeouts (send.py) and the
connection cap (connections.py).
"""
