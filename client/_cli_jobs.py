"""`gelastic jobs`, `status`, `result` and `cancel`: a job's state, outcome and stop.

Also the finished job's state and result as `submit --watch` and `result` both print them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from client._cli_output import EXIT_OK, EXIT_USAGE, CliError, _print_json, _show, exit_code_of
from client._client import Client, Job
from client._scheduler_error import write_scheduler_error_file
from client._tables import jobs_table, result_text, status_text, to_jsonable
from client.model import JobState, RunResult
from client.results import PickledReturnValue


def _result_json(job_id: str, state: JobState, result: RunResult | None) -> dict[str, Any]:
    out: dict[str, Any] = {"job_id": job_id, "state": state.value, "finished": result is not None}
    if result is not None:
        # The bytes themselves are not printed: `return_value_sizes` says what there is.
        out["result"] = to_jsonable(dataclasses.replace(result, raw_return_values={}))
        out["root_cause"] = to_jsonable(result.root_cause)
    return out


def _finished(job: Job) -> tuple[JobState, RunResult | None]:
    # The result first: once it exists, the state read after it is terminal too.
    result = job.poll()
    return job.status().state, result


def _cmd_jobs(client: Client, args: argparse.Namespace) -> int:
    jobs = client.list_jobs(include_finished=not args.active)
    if args.json:
        _print_json(jobs)
    else:
        _show(jobs_table(jobs))
    return EXIT_OK


def _cmd_status(client: Client, args: argparse.Namespace) -> int:
    status = client.job(args.job_id).status()
    if args.json:
        _print_json(status)
    else:
        _show(status_text(status))
    return EXIT_OK


def _cmd_result(client: Client, args: argparse.Namespace) -> int:
    job = client.job(args.job_id)
    state, result = _finished(job)
    # JSON values are printed as they are; pickles only with --trusted-load.
    pickled = result is not None and any(
        isinstance(v, PickledReturnValue) for v in result.return_values.values()
    )
    if result is not None and args.trusted_load and pickled:
        print(
            "gelastic: warning: --trusted-load unpickles return values nobody verified; "
            "this runs code chosen by whoever wrote them",
            file=sys.stderr,
        )
        try:
            loaded = result.trusted_return_values()
        except Exception as exc:
            raise CliError(f"cannot load the return values: {type(exc).__name__}: {exc}") from None
        result = dataclasses.replace(result, return_values=loaded)
    if args.json:
        _print_json(_result_json(job.job_id, state, result))
    if result is None:
        if not args.json:
            _show(f"gelastic: job {job.job_id} is still {state.value}", sys.stderr)
        return EXIT_USAGE
    if not args.json:
        _show(result_text(result, state.value))
    write_scheduler_error_file(result, result.name or job.job_id)
    return exit_code_of(state)


def _cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    job = client.job(args.job_id)
    status = job.cancel()
    if args.wait and not status.state.is_terminal():
        try:
            job.wait(args.wait_timeout)
        except TimeoutError as exc:
            raise CliError(str(exc)) from None
        status = job.status()
    if args.json:
        _print_json(status)
    else:
        _show(f"{status.job_id} {status.state.value}")
    return EXIT_OK
