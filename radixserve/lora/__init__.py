"""Multi-LoRA serving: adapters read from PEFT folders, their radix namespace, the batch deltas.

Torch-free here and in request.py and namespace.py (the API process and the offline API's
front import them); peft_format.py, adapters.py, segments.py and manager.py are the engine's.
"""
