"""The CLI as a new user meets it, without servers: progress lines, status, flags, help, versions."""

from __future__ import annotations

import argparse
import io
import re

import pytest

from client import cli
from client._logrelay import RankWriter, parse_logs_choice
from client._progress import _Progress
from client._tables import status_text
from client.model import JobState, JobStatus, Member, WorkerState, WorkerStatus
from coordinator import cli as coordinator_cli
from gelastic._cli_run import run_parser
from nodeagent import cli as nodeagent_cli
from protos.gelastic.v1 import gelastic_pb2 as pb


class _Out(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def _update(state: int, reason: str, *events: pb.Event, **job: object) -> pb.JobUpdate:
    return pb.JobUpdate(
        job=pb.Job(job_id="job-1", state=state, reason=reason, **job),  # type: ignore[arg-type]
        events=list(events),
    )


# ---- progress lines (item 9, 12) --------------------------------------------------------------


def test_a_countdown_off_a_terminal_is_one_line_with_the_job_prefix_and_no_doubled_state() -> None:
    out = _Out(tty=False)
    p = _Progress(out)
    for left in (3, 2, 1, 0):
        p.show(
            _update(pb.JOB_STATE_RENDEZVOUS, f"rendezvous: 2/3 nodes, last call closes in {left} s")
        )
    p.show(
        _update(
            pb.JOB_STATE_SUCCEEDED,
            "all workers succeeded",
            pb.Event(seq=5, kind="round_formed", reason="round 1 formed with 2 nodes"),
            pb.Event(seq=6, kind="finished", reason="SUCCEEDED: all workers succeeded"),
        )
    )
    p.done()
    lines = out.getvalue().splitlines()
    assert lines == [
        "[job-1] rendezvous: 2/3 nodes, last call closes in 3 s",
        "[job-1] round 1 formed with 2 nodes",
        "[job-1] succeeded: all workers succeeded",
    ]


def test_a_new_state_is_a_new_line_off_a_terminal() -> None:
    out = _Out(tty=False)
    p = _Progress(out)
    p.show(_update(pb.JOB_STATE_QUEUED, "rendezvous: 1/2 nodes, waiting up to 30 s more"))
    p.show(_update(pb.JOB_STATE_QUEUED, "rendezvous: 1/2 nodes, waiting up to 29 s more"))
    p.show(_update(pb.JOB_STATE_QUEUED, "rendezvous: 2/3 nodes, waiting up to 28 s more"))
    assert len(out.getvalue().splitlines()) == 2


def test_after_a_coordinator_restart_progress_says_re_attaching_and_replays_nothing() -> None:
    out = _Out(tty=False)
    p = _Progress(out)
    formed = pb.Event(seq=3, kind="round_formed", reason="round 1 formed with 2 nodes")
    p.show(_update(pb.JOB_STATE_RUNNING, "attempt 0 running", formed))
    # The coordinator went away; a new watch replays the whole timeline.
    p.reattaching()
    recovered = pb.Event(
        seq=9, kind="recovered", reason="coordinator restarted; running job recovered"
    )
    p.show(_update(pb.JOB_STATE_RUNNING, "attempt 0 running", formed, recovered))
    text = out.getvalue()
    assert text.count("round 1 formed") == 1
    assert "[job-1] coordinator restarted; re-attaching" in text
    assert "node lost" not in text and "queued" not in text


def test_a_recovered_event_from_before_the_watch_is_not_news() -> None:
    out = _Out(tty=False)
    p = _Progress(out)
    old = pb.Event(seq=2, kind="recovered", reason="coordinator restarted; running job recovered")
    p.show(_update(pb.JOB_STATE_RUNNING, "attempt 0 running", old))
    assert "re-attaching" not in out.getvalue()


def test_worker_output_goes_above_the_updating_line_on_a_terminal() -> None:
    out = _Out(tty=True)
    logs = io.BytesIO()
    p = _Progress(out)
    p.show(_update(pb.JOB_STATE_RENDEZVOUS, "rendezvous: 1/2 nodes"))
    p.write_above(logs, b"hello\n")  # type: ignore[arg-type]
    assert logs.getvalue() == b"hello\n"
    # The line is cleared before the output and drawn again after it.
    assert out.getvalue().endswith("\r\x1b[2K[job-1] rendezvous: 1/2 nodes")


# ---- worker output (item 7) -------------------------------------------------------------------


def test_rank_writer_prefixes_whole_lines_and_strips_controls_on_a_terminal() -> None:
    written: list[bytes] = []
    w = RankWriter(3, io.BytesIO(), lambda _d, b: written.append(b), prefix=True, screen=True)  # type: ignore[arg-type]
    w.feed(b"one\ntw")
    w.feed(b"o\x1b]0;title\x07\x1b[2J\nthree")
    w.finish()
    assert b"".join(written) == b"[3]:one\n[3]:two\n[3]:three\n"
    assert written[0] == b"[3]:one\n"  # a partial line waits for its newline


def test_rank_writer_leaves_bytes_alone_off_a_terminal() -> None:
    written: list[bytes] = []
    w = RankWriter(0, io.BytesIO(), lambda _d, b: written.append(b), prefix=False, screen=False)  # type: ignore[arg-type]
    w.feed(b"\x1b[31mred\x1b[0m\n")
    w.finish()
    assert written == [b"\x1b[31mred\x1b[0m\n"]


def test_logs_choice() -> None:
    assert parse_logs_choice("rank0") == "0"
    assert parse_logs_choice("all") == "all"
    assert parse_logs_choice("7") == "7"
    for bad in ("rank1", "-1", "all\n", "1" * 8):
        with pytest.raises(ValueError):
            parse_logs_choice(bad)


# ---- flags that only mean something with --watch (item 8) ---------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--wait-timeout", "3"], "--wait-timeout needs --watch"),
        (["--logs"], "--logs needs --watch"),
        (["--watch", "--logs", "rank9x"], "--logs: must be rank0, all"),
        (["--watch", "--json", "--logs", "all"], "not with --json"),
    ],
)
def test_watch_only_flags_are_refused_without_watch(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Refused before any connection: nothing listens at this address.
    code = cli.main(["--coordinator", "127.0.0.1:1", "submit", *args, "--", "python", "x.py"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE
    assert message in err and len(err.strip().splitlines()) == 1
    assert "cannot reach" not in err


# ---- status of a finished or queued job (item 10, 12) -------------------------------------------


def _status(state: JobState, workers: tuple[WorkerStatus, ...], **kw: object) -> JobStatus:
    return JobStatus(
        job_id="job-1",
        name="",
        state=state,
        reason="",
        attempt=0,
        round=1,
        max_restarts=0,
        min_nodes=2,
        max_nodes=3,
        workers=workers,
        **kw,  # type: ignore[arg-type]
    )


def test_status_of_finished_ranks_shows_their_exit_not_stale_samples() -> None:
    ranks = (
        WorkerStatus(0, 0, "n0", WorkerState.SUCCEEDED, 11, 97.5, 300 << 20, "running", 0),
        WorkerStatus(1, 0, "n1", WorkerState.FAILED, 12, 55.0, 200 << 20, "sleeping", -9),
        WorkerStatus(2, 0, "n1", WorkerState.HEALTHY, 13, 12.5, 100 << 20, "running", None),
    )
    text = status_text(_status(JobState.RUNNING, ranks, members=(Member("n0", "a", 0, 1, True),)))
    rows = {int(line.split()[0]): line for line in text.splitlines()[-3:]}
    assert "exited 0" in rows[0] and "97.5" not in rows[0] and "running" not in rows[0]
    assert "signal SIGKILL" in rows[1] and "55.0" not in rows[1] and "sleeping" not in rows[1]
    assert "12.5" in rows[2] and "running" in rows[2]  # still running: its samples are live


def test_status_of_a_queued_job_counts_the_nodes_that_joined() -> None:
    text = status_text(_status(JobState.QUEUED, (), nodes_joined=2))
    assert re.search(r"^nodes:\s+2 joined \(min 2, max 3\)", text, re.M), text


# ---- help and versions (item 11) ----------------------------------------------------------------


def _walk(parser: argparse.ArgumentParser, path: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                if not helps.get(name):
                    missing.append(f"{path} {name}")
                missing += _walk(sub, f"{path} {name}")
            continue
        if not action.help or action.help == argparse.SUPPRESS:
            missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_flag_of_every_program_has_help() -> None:
    missing = (
        _walk(cli._parser(), "gelastic")
        + _walk(run_parser(), "gelastic run")
        + _walk(coordinator_cli._parser(), "coordinator")
        + _walk(nodeagent_cli._parser(), "nodeagent")
    )
    assert missing == []


def test_run_help_lists_the_torchrun_flags_it_accepts() -> None:
    groups = {g.title: g for g in run_parser()._action_groups}
    compat = groups["accepted for compatibility with torchrun"]
    flags = {s for a in compat._group_actions for s in a.option_strings}
    assert {"--rdzv-backend", "--rdzv-id", "--monitor-interval", "--standalone"} <= flags
    assert "accepted for compatibility with torchrun" in run_parser().format_help()
    refused = {s for a in groups["torchrun flags refused"]._group_actions for s in a.option_strings}
    assert {"--logs-specs", "--numa-binding", "--rdzv-endpoint", "--node-rank"} <= refused
    assert not flags & refused


@pytest.mark.parametrize("main", [cli.main, coordinator_cli.main, nodeagent_cli.main])
def test_version(main: object, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])  # type: ignore[operator]
    assert done.value.code == 0
    assert re.fullmatch(r"(gelastic|coordinator|nodeagent) \d+\.\d+\S*\n", capsys.readouterr().out)


def test_followed_event_rows_line_up_with_their_header_for_every_kind() -> None:
    from client._tables import event_line, event_line_header
    from client.model import JobEvent

    kinds = [
        "submitted",
        "round_formed",
        "workers_started",
        "round_started",
        "worker_exited",
        "worker_failed",
        "stopping",
        "restart",
        "reform",
        "node_lost",
        "barrier_wait",
        "barrier_timeout",
        "stop_timeout",
        "unkillable",
        "adopted",
        "recovered",
        "assign_undeliverable",
        "finished",
    ]
    header = event_line_header()
    start = header.index("ATTEMPT")
    for kind in kinds:
        row = event_line(JobEvent(10001, "job-1", 1.0e9, kind, "why", 0, 1, "node-0", 3))
        # The ATTEMPT column ends where its header does, whatever the kind before it.
        assert row[start : start + len("ATTEMPT")].strip() == "0", (kind, row)


@pytest.mark.parametrize(
    ("tty", "json_out", "want"), [(True, False, "0"), (False, False, None), (True, True, None)]
)
def test_watch_shows_rank_0_by_default_on_a_terminal_only(
    tty: bool, json_out: bool, want: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli.sys, "stdout", _Out(tty))
    argv = ["submit", "--watch", *(["--json"] if json_out else []), "--", "python", "x.py"]
    args = cli._parser().parse_args(argv)
    cli._check_submit_flags(args)
    assert args.logs == want
