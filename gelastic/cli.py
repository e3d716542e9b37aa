"""`gelastic`, the command: every subcommand, `run` included.

`gelastic run` embeds a coordinator and a node agent in this process, so it lives in this
package, above both (`gelastic._cli_run`, `gelastic._cli_run_nodes`); every other subcommand
only talks to a coordinator, and `client.cli` serves it. `client.cli`'s parser lists `run` with
the others, so `gelastic --help` names them all, and `gelastic run --help` is `run`'s own.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from client import cli as client_cli

__all__ = ["main", "run"]


def run(argv: Sequence[str]) -> int:
    """`gelastic run ARGV`: torchrun on this host, or one node of a job that several form."""
    # Imported here: the other subcommands need neither the coordinator nor the agent.
    from gelastic._cli_run_nodes import main as run_main

    return run_main(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """The `gelastic` console script: `run` here, the other subcommands `client.cli`'s."""
    return client_cli.main(argv, run=run)


if __name__ == "__main__":
    sys.exit(main())
