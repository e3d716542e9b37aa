"""The stall flags `gelastic submit` and `gelastic run` share: `--stall-timeout`, `--stall-action`
(the spec's `stall_timeout` and `stall_action`, one to one)."""

from __future__ import annotations

import argparse

from client._spec_fields import STALL_ACTIONS

__all__ = ["add_stall_options"]


def add_stall_options(p: argparse.ArgumentParser, timeout: float, action: str) -> None:
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=timeout,
        metavar="S",
        help="seconds without a step (client.progress) after which the job is stalled: an event "
        "names the ranks behind (default %(default)g: off)",
    )
    p.add_argument(
        "--stall-action",
        choices=STALL_ACTIONS,
        default=action,
        help="what a stall does: report it, restart the job (a HANG failure of the ranks "
        "behind) or fail it (default %(default)s)",
    )
