"""`gelastic submit`: the JobSpec its flags describe, and watching the job to its end.

Checks the flags and the spec before any connection; with --watch, shows the progress lines
with the ranks' output above them, and exits with the job's status.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from client._cli_jobs import _finished, _result_json
from client._cli_output import EXIT_INTERRUPTED, EXIT_OK, CliError, _print_json, _show, exit_code_of
from client._client import Client, Job
from client._logrelay import LogRelay, parse_logs_choice
from client._progress import _Progress
from client._scheduler_error import write_scheduler_error_file
from client._tables import result_text
from client.model import (
    MAX_SPEC_BYTES,
    JobSpec,
    JobState,
    Role,
    SpecError,
    is_function_reference,
    roles_from_json,
)
from client.wire import job_status_from_pb

LOGS_DRAIN_S = 5.0
"""How long `submit --watch --logs` waits for the last output once the job has ended."""


def build_spec(args: argparse.Namespace) -> JobSpec:
    """The JobSpec that `gelastic submit`'s flags describe."""
    entry = list(args.entry)
    if entry and entry[0] == "--":
        entry = entry[1:]
    roles = _read_roles(args, entry)
    if not entry and not roles:
        raise CliError("give the command to run after '--'")
    common: dict[str, Any] = dict(
        nproc_per_node=args.nproc_per_node,
        min_nodes=args.nnodes[0],
        max_nodes=args.nnodes[1],
        max_restarts=args.max_restarts,
        role=args.role,
        name=args.name,
        env=dict(args.env),
        redirects=args.redirects,
        tee=args.tee,
        join_timeout=args.join_timeout,
        last_call_timeout=args.last_call_timeout,
        exit_barrier_timeout=args.exit_barrier_timeout,
        stop_grace=args.stop_grace,
        restart_backoff=args.restart_backoff,
        restart_policy=args.restart_policy,
        stall_timeout=args.stall_timeout,
        stall_action=args.stall_action,
        scale_up=args.scale_up,
        watchdog=args.watchdog,
        torch_metrics=args.torch_metrics,
        cwd=args.cwd,
        preload=tuple(args.preload),
        standby_linger=args.standby_linger,
        wait_for_nodes=args.wait_for_nodes,
    )
    if roles:
        return JobSpec(roles=roles, **common)
    if args.module:
        return JobSpec(entrypoint=[args.python, "-m", entry[0]], args=entry[1:], **common)
    if is_function_reference(entry[0]):
        # A function entrypoint: its arguments are the remaining words, as strings.
        return JobSpec(entrypoint=entry[0], args=tuple(entry[1:]), **common)
    return JobSpec(entrypoint=entry, **common)


def _read_roles(args: argparse.Namespace, entry: Sequence[str]) -> tuple[Role, ...]:
    """The roles of `--roles FILE` (read once), or () without it."""
    if args.roles is None:
        return ()
    cached: tuple[Role, ...] | None = getattr(args, "_roles", None)
    if cached is not None:
        return cached
    if entry or args.module:
        raise CliError("--roles: each role gives its command in the file, not after '--'")
    d = JobSpec()
    if (args.nnodes, args.nproc_per_node, args.role) != ((1, 1), d.nproc_per_node, d.role):
        raise CliError(
            "--roles: give each role's nodes and workers in the file, not --nnodes, "
            "--nproc-per-node or --role"
        )
    try:
        with open(args.roles, "rb") as f:
            text = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise CliError(f"--roles: cannot read {args.roles}: {exc.strerror or exc}") from None
    try:
        roles = roles_from_json(text)
    except SpecError as exc:
        raise CliError(f"invalid job: {exc}") from None
    args._roles = roles
    return roles


def _check_spec(spec: JobSpec) -> None:
    # A bad command line is reported before any connection attempt.
    try:
        spec.validate()
    except SpecError as exc:
        raise CliError(f"invalid job: {exc}") from None


def _check_submit_flags(args: argparse.Namespace) -> None:
    # Refused rather than ignored: each of these only means something while watching.
    if args.wait_timeout is not None and not args.watch:
        raise CliError("--wait-timeout needs --watch")
    if args.logs is not None:
        if not args.watch:
            raise CliError("--logs needs --watch")
        try:
            args.logs = parse_logs_choice(args.logs)
        except ValueError as exc:
            raise CliError(f"--logs: {exc}") from None
        if args.json and args.logs != "none":
            raise CliError("--logs writes the workers' output to stdout: not with --json")
    elif args.watch and not args.json and sys.stdout.isatty():
        args.logs = "0"


class _WatchProgress(_Progress):
    """The progress lines, and the ranks' output streamed above them."""

    def __init__(self, out: TextIO, job: Job, logs: str | None) -> None:
        super().__init__(out)
        self.relay = LogRelay(job, logs, self.write_above) if logs not in (None, "none") else None

    def show(self, update: Any) -> None:
        super().show(update)
        if self.relay is not None:
            self.relay.update(job_status_from_pb(update.job))


_STILL: dict[JobState | None, str] = {
    None: "queued",
    JobState.QUEUED: "queued",
    JobState.RENDEZVOUS: "in rendezvous",
    JobState.STOPPING: "stopping",
}
"""What a job goes on doing once `submit --watch` detaches; any other state: running."""


def _cmd_submit(client: Client, args: argparse.Namespace) -> int:
    job = client.submit(build_spec(args))
    if not args.watch:
        if args.json:
            _print_json({"job_id": job.job_id})
        else:
            print(job.job_id, flush=True)
        return EXIT_OK
    if not args.json:
        print(job.job_id, flush=True)
    printer = _WatchProgress(sys.stderr, job, args.logs)
    try:
        job.wait(args.wait_timeout, progress=printer)
    except TimeoutError as exc:
        raise CliError(str(exc)) from None
    except KeyboardInterrupt:
        # Ctrl-C stops the watching, not the job.
        printer.done()
        print(
            f"gelastic submit: detached; job {job.job_id} is still "
            f"{_STILL.get(printer.state, 'running')} (gelastic cancel {job.job_id})",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED
    if printer.relay is not None:
        printer.relay.join(LOGS_DRAIN_S)
    state, result = _finished(job)
    if args.json:
        _print_json(_result_json(job.job_id, state, result))
    elif result is not None:
        _show(result_text(result, state.value))
    if result is not None:
        write_scheduler_error_file(result, result.name or job.job_id)
    return exit_code_of(state)
