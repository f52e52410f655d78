"""Where the repository's files are, for tests that read them (README, docs/, manifests,
sources)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = REPO_ROOT / "docs"  # one page a topic; README.md links into them
