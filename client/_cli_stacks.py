"""`gelastic stack`: every rank's stack of a running job, grouped, or the captures it keeps.

A capture is taken through the coordinator (each node's agent reads its own workers); identical
stacks are shown once with the ranks that share them, the odd ones first. `--last` and
`--capture` read what the job keeps instead, which outlives its workers.
"""

from __future__ import annotations

import argparse

from client._cli_output import EXIT_OK, CliError, _print_json, _show
from client._client import Client
from client._client_stacks import STACK_WAIT_S
from client.stacks import CAPTURE_ID, StackCapture, format_capture

STACK_HELP = (
    "show where every rank of a running job is: each rank's python stack (py-spy), "
    "identical stacks grouped, the odd ones first; kept with the job"
)
MAX_WAIT_S = 60.0


def _wait_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from None
    if not 0 < seconds <= MAX_WAIT_S:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most {MAX_WAIT_S:g} s")
    return seconds


def add_stack_arguments(s: argparse.ArgumentParser) -> None:
    """`gelastic stack`'s arguments."""
    s.add_argument("job_id", metavar="JOB", help="the job's id")
    s.add_argument("--rank", type=int, default=None, help="only this global rank")
    s.add_argument("--native", action="store_true", help="with C/C++ frames (py-spy --native)")
    s.add_argument(
        "--wait",
        type=_wait_seconds,
        default=STACK_WAIT_S,
        metavar="S",
        help="how long to wait for the nodes' answers (default %(default)s, at most 60); a "
        "rank whose node did not answer is listed as such",
    )
    kept = s.add_mutually_exclusive_group()
    kept.add_argument(
        "--last", action="store_true", help="show the latest capture the job keeps; take none"
    )
    kept.add_argument("--all", action="store_true", help="show every capture the job keeps")
    kept.add_argument("--capture", default="", metavar="ID", help="show the kept capture ID")
    s.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _cmd_stack(client: Client, args: argparse.Namespace) -> int:
    captures: list[StackCapture]
    if args.capture and not CAPTURE_ID.fullmatch(args.capture):
        raise CliError(f"--capture: not a capture id: {args.capture[:80]!r}")
    if args.last or args.all or args.capture:
        kept = client.stacks(args.job_id, args.capture or "")
        if not kept:
            raise CliError(
                f"job {args.job_id} keeps no stack capture; take one with "
                f"'gelastic stack {args.job_id}'"
            )
        captures = kept if args.all else kept[-1:]
    else:
        captures = [
            client.capture_stacks(args.job_id, rank=args.rank, native=args.native, wait=args.wait)
        ]
    if args.json:
        _print_json(captures if args.all else captures[0])
        return EXIT_OK
    _show("\n\n".join(format_capture(c) for c in captures))
    return EXIT_OK
