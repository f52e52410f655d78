"""Where the repository's files are, for tests that read them (README, manifests, sources)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
