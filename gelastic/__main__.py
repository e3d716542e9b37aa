"""`python -m gelastic`: the `gelastic` command, as its console script runs it."""

from __future__ import annotations

import sys

from gelastic.cli import main

if __name__ == "__main__":
    sys.exit(main())
