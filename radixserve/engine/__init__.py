"""The engine process's side: the step loop, the model runner, the sampler, the offline LLM.

Everything under here may import torch; the API process and the router never import it
(import-linter enforces this, see pyproject.toml).
"""
