"""`gelastic`'s subcommands that talk to a coordinator: submit jobs and follow them.

A thin layer over the Python client: flags become a JobSpec, domain objects become aligned
tables or (with --json) JSON. Exit codes: 0 success, 1 the job failed or was cancelled, 2 a
usage or connection error, reported as one line on stderr.

Here: the entry point, the connection, and `gelastic dashboard`; the parser and the other
commands live in the private `client._cli_*` modules. `gelastic run` embeds a coordinator and
an agent, so it lives a layer up: the `gelastic` command is `gelastic.cli.main`, which hands
`main` here every subcommand and the function that runs `run`.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable, Sequence

import grpc

from client._cli_jobs import _cmd_cancel, _cmd_jobs, _cmd_result, _cmd_status
from client._cli_logs import _cmd_events, _cmd_logs
from client._cli_nodes import _cmd_nodes
from client._cli_output import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    _show,
    one_line,
)
from client._cli_parser import (
    _check_global_options,
    _parser,
    _run_argv,
    _unrecognized,
    parse_nnodes,
)
from client._cli_stacks import _cmd_stack
from client._cli_submit import _check_spec, _check_submit_flags, _cmd_submit, build_spec
from client._cli_top import _cmd_top
from client._client import DEFAULT_COORDINATOR, Client, GelasticError
from client.coordinators import parse_coordinators
from client.model import is_host
from client.security import Security, describe_tls_failure

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "CliError", "main", "parse_nnodes"]


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a plain HOST:PORT or [V6]:PORT target; None for other gRPC targets."""
    if "://" in address or address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def check_reachable(address: str, timeout: float) -> None:
    """Fail fast, with the operating system's reason, when nothing listens at `address`.

    gRPC would instead retry until the call's deadline and then report only
    "failed to connect"; a plain TCP connect tells refused from unresolvable from silent.
    """
    target = _host_port(address)
    if target is not None:
        try:
            with socket.create_connection(target, timeout=timeout):
                return
        except socket.gaierror as exc:
            raise CliError(f"cannot reach the coordinator at {address}: {exc.strerror}") from None
        except TimeoutError:
            raise CliError(
                f"cannot reach the coordinator at {address}: no answer within {timeout:g} s"
            ) from None
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise CliError(f"cannot reach the coordinator at {address}: {reason}") from None
    with grpc.insecure_channel(address) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise CliError(
                f"cannot reach the coordinator at {address}: no connection within {timeout:g} s"
            ) from None


def check_any_reachable(addresses: Sequence[str], timeout: float) -> None:
    """`check_reachable` for a list of replicas: fine when any one of them is reachable."""
    if len(addresses) == 1:
        check_reachable(addresses[0], timeout)
        return
    reasons = []
    for address in addresses:
        try:
            check_reachable(address, timeout)
            return
        except CliError as exc:
            reasons.append(str(exc).removeprefix("cannot reach the coordinator at "))
    raise CliError(f"cannot reach any coordinator of the list: {'; '.join(reasons)}")


def _describe(exc: GelasticError, address: str, security: Security | None = None) -> str:
    details = one_line(str(exc))
    if exc.code == grpc.StatusCode.UNAVAILABLE and "," in address:
        return f"cannot reach the leader of the coordinators {address}: {details}"
    if exc.code == grpc.StatusCode.UNAVAILABLE:
        # grpc says "Socket closed" for most TLS mismatches: one handshake of our own names it.
        why = describe_tls_failure(address, security) if security is not None else ""
        return f"cannot reach the coordinator at {address}: {why or details}"
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the coordinator at {address} did not answer in time: {details}"
    return details


def _connect(args: argparse.Namespace) -> Client:
    address = args.coordinator or os.environ.get("GELASTIC_COORDINATOR") or DEFAULT_COORDINATOR
    security = Security.from_env(
        args.token_file or None,
        getattr(args, "tls_ca", "") or None,
        tls=getattr(args, "tls", False) or None,
        insecure=getattr(args, "insecure", False) or None,
        tls_cert=getattr(args, "tls_cert", "") or None,
        tls_key=getattr(args, "tls_key", "") or None,
        tls_server_name=getattr(args, "tls_server_name", "") or None,
    )
    addresses = parse_coordinators(address)
    # Refused before any connection: the token must not go out in clear text.
    for one in addresses:
        security.check_target(one)
    check_any_reachable(addresses, args.connect_timeout)
    return Client(",".join(addresses), timeout=args.timeout, security=security)


def _cmd_dashboard(client: Client, args: argparse.Namespace) -> int:
    url = client.dashboard_url()
    if not url:
        raise CliError(
            "the coordinator serves no dashboard: start it with "
            "'coordinator serve --dashboard-port PORT'"
        )
    problem = _dashboard_url_problem(url)
    if problem:
        # The URL is the coordinator's word: a browser is handed only a web page of a host.
        raise CliError(f"the coordinator reported a dashboard URL that {problem}: {url!r:.200}")
    _show(url)
    # The login page asks for a token: say which one, on stderr (stdout is the URL alone).
    token_file = args.token_file or os.environ.get("GELASTIC_TOKEN_FILE", "")
    _show(
        f"gelastic dashboard: log in with the token in {token_file} (the client token this "
        "command sent)"
        if token_file
        else "gelastic dashboard: this command sent no token; if the page asks for one, log in "
        "with the coordinator's client token (the file of its --client-token-file, else of "
        "its --token-file)",
        sys.stderr,
    )
    if not args.no_browser and sys.stdout.isatty() and _desktop_browser():
        import webbrowser

        webbrowser.open(url)
    return EXIT_OK


def _dashboard_url_problem(url: str) -> str:
    """Why `url` is not an http(s) URL of a host and port ("" when it is one)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "cannot be parsed"
    if parts.scheme not in ("http", "https"):
        return "is not http or https"
    if parts.username is not None or parts.password is not None:
        return "carries a user name"
    host = parts.hostname or ""
    if not is_host(host) or port is None:
        return "does not name a host and a port"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return "is not the dashboard's own page"
    return ""


def _desktop_browser() -> bool:
    """A graphical browser could open here: a display on Linux, or macOS or Windows."""
    if sys.platform not in ("darwin", "win32") and not (
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    ):
        return False
    import webbrowser

    try:
        webbrowser.get()
    except webbrowser.Error:
        return False
    return True


_COMMANDS: dict[str, Callable[[Client, argparse.Namespace], int]] = {
    "submit": _cmd_submit,
    "jobs": _cmd_jobs,
    "nodes": _cmd_nodes,
    "status": _cmd_status,
    "top": _cmd_top,
    "result": _cmd_result,
    "logs": _cmd_logs,
    "events": _cmd_events,
    "stack": _cmd_stack,
    "cancel": _cmd_cancel,
    "dashboard": _cmd_dashboard,
}


def main(
    argv: Sequence[str] | None = None, *, run: Callable[[list[str]], int] | None = None
) -> int:
    """`gelastic ARGV`; `run` runs `gelastic run`'s arguments (the `gelastic` command's own)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    run_args = _run_argv(argv)
    if run_args is not None:
        if run is None:
            _show(
                "gelastic run: not served by client.cli; run 'gelastic run' "
                "(or 'python -m gelastic run')",
                sys.stderr,
            )
            return EXIT_USAGE
        return run(run_args)
    parser = _parser()
    args, extra = parser.parse_known_args(_check_global_options(parser, argv))
    if extra:
        _unrecognized(parser, args.command, extra)
    address = args.coordinator or os.environ.get("GELASTIC_COORDINATOR") or DEFAULT_COORDINATOR
    client: Client | None = None
    try:
        if args.command == "submit":
            _check_submit_flags(args)
            _check_spec(build_spec(args))
        try:
            client = _connect(args)
        except ValueError as exc:  # an unreadable token file or TLS setting
            raise CliError(str(exc), EXIT_USAGE) from None
        return _COMMANDS[args.command](client, args)
    except CliError as exc:
        _show(f"gelastic {args.command}: {exc}", sys.stderr)
        return exc.code
    except GelasticError as exc:
        security = client.security if client is not None else None
        _show(f"gelastic {args.command}: {_describe(exc, address, security)}", sys.stderr)
        return EXIT_USAGE
    except grpc.RpcError as exc:
        _show(f"gelastic {args.command}: {one_line(str(exc))}", sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `gelastic logs JOB | head`: the reader is gone; say nothing more.
        _silence_stdout()
        return EXIT_OK
    finally:
        if client is not None:
            client.close()


def _silence_stdout() -> None:
    # Python would report the broken pipe again when it flushes stdout at exit.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
