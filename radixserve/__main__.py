"""`python -m radixserve ...`: the same entry point as the `radixserve` console script."""

from __future__ import annotations

from radixserve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
