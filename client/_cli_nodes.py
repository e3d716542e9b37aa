"""`gelastic nodes`: list the nodes, forget lost ones, clear a node's quarantine, drain a node
and undrain it."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from client._cli_output import EXIT_OK, CliError, _print_json, _show
from client._client import Client
from client._tables import nodes_table

MAX_FORGET = 1000
"""Most node names one `gelastic nodes --forget ...` takes."""


def _check(args: argparse.Namespace) -> None:
    for flag in ("forget", "clear_quarantine", "drain", "undrain"):
        if len(getattr(args, flag)) > MAX_FORGET:
            raise CliError(f"--{flag.replace('_', '-')}: at most {MAX_FORGET} names at once")
    if not args.drain and (args.deadline is not None or args.reason):
        raise CliError("--deadline and --reason go with --drain NAME")
    if args.deadline is not None and not (math.isfinite(args.deadline) and args.deadline > 0):
        raise CliError(f"--deadline: must be a number of seconds > 0, got {args.deadline}")


def _each(
    args: argparse.Namespace, names: list[str], key: str, call: Callable[[str], object], says: str
) -> None:
    """Run `call(name)` for each name; print what it did (or its JSON under `key`). `says` is
    "done|not done"; {} in it is what the call returned."""
    done = {name: call(name) for name in names}
    if args.json:
        _print_json({key: [n for n, ok in done.items() if ok]})
        return
    yes, no = says.split("|")
    for name, ok in done.items():
        print(f"{name}: {yes.format(ok) if ok else no}", flush=True)


def _cmd_nodes(client: Client, args: argparse.Namespace) -> int:
    _check(args)
    acted = False
    if args.undrain:
        _each(args, args.undrain, "undrained", client.undrain_node, "undrained|not drained")
        acted = True
    if args.drain:
        deadline = args.deadline
        when = f"workers killed in {deadline:g} s" if deadline else "each job's stop_grace"
        _each(
            args,
            args.drain,
            "drained",
            lambda name: client.drain_node(name, deadline, args.reason),
            "{} (" + when + "); `gelastic nodes` shows when it is drained|no such node",
        )
        acted = True
    if args.clear_quarantine:
        _each(
            args,
            args.clear_quarantine,
            "cleared",
            client.clear_quarantine,
            "quarantine cleared|not quarantined",
        )
        acted = True
    if args.forget:
        _each(args, args.forget, "forgotten", client.forget_node, "forgotten|no such node")
        acted = True
    if acted:
        return EXIT_OK
    nodes = client.list_nodes()
    if args.json:
        _print_json(nodes)
    else:
        _show(nodes_table(nodes))
    return EXIT_OK
