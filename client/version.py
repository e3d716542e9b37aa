"""`--version` for the three programs: the installed distribution's version, looked up when asked."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["VersionAction"]


class VersionAction(argparse.Action):
    """--version: the installed distribution's version, looked up only when asked."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        kw.setdefault("help", "print the version and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kw: object) -> None:
        import importlib.metadata

        try:
            version = importlib.metadata.version("gelastic")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown (not installed)"
        sys.stdout.write(f"{parser.prog} {version}\n")
        parser.exit(0)
