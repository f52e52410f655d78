"""The process boundary, checked in a fresh interpreter: the offline LLM and the router load
none of the HTTP server, and the router no torch (import-linter checks the static imports;
this checks what importing really loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.repo import REPO_ROOT

ROOT = REPO_ROOT


def loaded_modules(module: str) -> list[str]:
    """Every module in sys.modules after `import module` in a new interpreter."""
    code = (f"import sys, json, {module}\n"
            "print(json.dumps(sorted(sys.modules)))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300, check=True)
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def under(modules: list[str], package: str) -> list[str]:
    return [m for m in modules if m == package or m.startswith(package + ".")]


def test_offline_llm_imports_nothing_from_the_server() -> None:
    loaded = loaded_modules("radixserve.llm")
    assert "radixserve.llm" in loaded
    assert under(loaded, "radixserve.server") == []


def test_router_imports_neither_the_server_nor_torch() -> None:
    loaded = loaded_modules("router.app")
    assert "router.app" in loaded
    assert under(loaded, "radixserve.server") == []
    assert under(loaded, "torch") == []
