"""The process boundary: the messages that cross it and the API process's engine handle.

The messages (messages.py) and the API process's handle on the engine process (client.py).
Torch-free: the API process imports this, never the engine.
"""
