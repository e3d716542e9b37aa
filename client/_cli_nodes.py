"""`gelastic nodes`: list the nodes, forget lost ones, clear a node's quarantine."""

from __future__ import annotations

import argparse

from client._cli_output import EXIT_OK, CliError, _print_json, _show
from client._client import Client
from client._tables import nodes_table

MAX_FORGET = 1000
"""Most node names one `gelastic nodes --forget ...` takes."""


def _cmd_nodes(client: Client, args: argparse.Namespace) -> int:
    if len(args.forget) > MAX_FORGET:
        raise CliError(f"--forget: at most {MAX_FORGET} names at once")
    if len(args.clear_quarantine) > MAX_FORGET:
        raise CliError(f"--clear-quarantine: at most {MAX_FORGET} names at once")
    if args.clear_quarantine:
        cleared = {name: client.clear_quarantine(name) for name in args.clear_quarantine}
        if args.json:
            _print_json({"cleared": [n for n, done in cleared.items() if done]})
        else:
            for name, done in cleared.items():
                print(
                    f"{name}: quarantine cleared" if done else f"{name}: not quarantined",
                    flush=True,
                )
        if not args.forget:
            return EXIT_OK
    if args.forget:
        forgotten = {name: client.forget_node(name) for name in args.forget}
        if args.json:
            _print_json({"forgotten": [n for n, done in forgotten.items() if done]})
        else:
            for name, done in forgotten.items():
                print(f"{name} forgotten" if done else f"{name}: no such node", flush=True)
        return EXIT_OK
    nodes = client.list_nodes()
    if args.json:
        _print_json(nodes)
    else:
        _show(nodes_table(nodes))
    return EXIT_OK
