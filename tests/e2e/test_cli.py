"""The `gelastic` command line as a subprocess against a live local cluster, and `gelastic run`.

Every call has a timeout; waits poll, never sleep a fixed time; `gelastic run` is checked to
leave no process behind (each run carries a unique environment marker its workers inherit).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing import errors as torch_errors

from client import JobSpec, JobState, RunResult, WorkerState
from gelastic.local import LocalCluster, poll_until
from tests._helpers import free_port
from tests.e2e.conftest import (
    MARKER_ENV,
    PY,
    assert_no_leftovers,
    assert_nothing_left,
    script,
)

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120
CALL_TIMEOUT = 60


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # One cluster for the read-only commands: each test's jobs end before the next test.
    c = LocalCluster(
        nodes=2,
        slots=2,
        workdir=tmp_path_factory.mktemp("cli-cluster"),
        lease=3.0,
        heartbeat_interval=0.5,
    )
    with c:
        yield c
    assert_no_leftovers(c)


def gelastic(
    *args: str,
    cluster: LocalCluster | None = None,
    env: dict[str, str] | None = None,
    timeout: float = CALL_TIMEOUT,
) -> subprocess.CompletedProcess[str]:
    argv = [PY, "-m", "gelastic"]
    if cluster is not None:
        argv += ["--coordinator", cluster.address]
    full_env = {k: v for k, v in os.environ.items() if k != "GELASTIC_COORDINATOR"}
    if cluster is not None:
        full_env["GELASTIC_TOKEN_FILE"] = cluster.token_file
    full_env.update(env or {})
    return subprocess.run(
        [*argv, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
    )


def parse_json(proc: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(proc.stdout)


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def submit(cluster: LocalCluster, *args: str) -> str:
    proc = gelastic("submit", *args, cluster=cluster)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    assert job_id and "\n" not in job_id
    return job_id


# ---- errors ---------------------------------------------------------------------------------


def test_unreachable_coordinator_is_one_line_and_exit_2() -> None:
    address = f"127.0.0.1:{free_port()}"
    for args in (["jobs"], ["status", "job-x"], ["submit", "--", PY, "-c", "pass"]):
        proc = gelastic("--coordinator", address, *args, timeout=30)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        line = one_line_error(proc)
        assert f"cannot reach the coordinator at {address}" in line, line
    # The address also comes from the environment.
    proc = gelastic("nodes", env={"GELASTIC_COORDINATOR": address}, timeout=30)
    assert proc.returncode == 2
    assert f"cannot reach the coordinator at {address}" in one_line_error(proc)


@pytest.mark.parametrize(
    "args",
    [
        ["frobnicate"],
        ["submit", "--nnodes", "3:2", "--", "python", "x.py"],
        ["submit", "--nproc-per-node", "0", "--", "python", "x.py"],
        ["submit", "--env", "NOEQUALS", "--", "python", "x.py"],
        ["submit"],
        ["logs"],
        ["run", "--nnodes", "2", "train.py"],
        ["run", "--nproc-per-node", "many", "train.py"],
        ["run", "-m", "--no-python", "train"],
        ["run", "--log-level", "chatty", "train.py"],
    ],
)
def test_bad_usage_is_one_line_and_exit_2(args: list[str]) -> None:
    # Nothing listens there: a usage error must be found before any connection attempt.
    proc = gelastic("--coordinator", f"127.0.0.1:{free_port()}", *args, timeout=30)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    line = one_line_error(proc)
    assert "cannot reach" not in line


def test_unknown_job_is_one_line_and_exit_2(shared: LocalCluster) -> None:
    proc = gelastic("status", "job-does-not-exist", cluster=shared)
    assert proc.returncode == 2
    assert "job-does-not-exist" in one_line_error(proc)


def test_command_lines_become_job_specs() -> None:
    from client.cli import _parser, build_spec

    def spec(*args: str) -> JobSpec:
        return build_spec(_parser().parse_args(["submit", *args]))

    s = spec(
        "--nnodes",
        "2:4",
        "--nproc-per-node",
        "8",
        "--max-restarts",
        "3",
        "--env",
        "A=b=c",
        "--",
        "python",
        "train.py",
        "--lr",
        "0.1",
    )
    assert s.argv == ("python", "train.py", "--lr", "0.1") and not s.is_function
    assert (s.min_nodes, s.max_nodes, s.nproc_per_node, s.max_restarts) == (2, 4, 8, 3)
    assert s.env == {"A": "b=c"}
    assert spec("-m", "pkg.train", "--lr", "1").argv == ("python", "-m", "pkg.train", "--lr", "1")
    fn = spec("--", "pkg.mod:fn", "x")
    assert fn.function == "pkg.mod:fn" and tuple(fn.args) == ("x",)


def test_json_view_of_values_json_cannot_carry() -> None:
    from client._tables import to_jsonable

    view = to_jsonable(
        RunResult(
            state=WorkerState.SUCCEEDED, return_values={0: {1, 2}, 1: float("nan"), 2: (1, "a")}
        )
    )
    assert json.loads(json.dumps(view, allow_nan=False)) == {
        "state": "SUCCEEDED",
        "return_values": {"0": "{1, 2}", "1": "nan", "2": [1, "a"]},
        "failures": {},
        "attempts": [],
        "reason": "",
        "job_id": "",
        "name": "",
        "raw_return_values": {},
        "return_value_sizes": {},
        "return_values_verified": False,
    }


# ---- reading a finished job -----------------------------------------------------------------


def test_submit_then_every_read_command(shared: LocalCluster) -> None:
    job_id = submit(
        shared,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--name",
        "hello",
        "--",
        PY,
        script("cli_hello.py"),
    )
    assert shared.client.job(job_id).wait(TIMEOUT).state.value == "SUCCEEDED"

    proc = gelastic("jobs", cluster=shared)
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.splitlines()
    assert header.split()[:3] == ["JOB", "NAME", "STATE"]
    row = next(r for r in rows if r.startswith(job_id))
    assert row.split()[1:3] == ["hello", "SUCCEEDED"]
    jobs = parse_json(gelastic("jobs", "--json", cluster=shared))
    mine = next(j for j in jobs if j["job_id"] == job_id)
    assert mine["state"] == "SUCCEEDED" and mine["name"] == "hello"
    assert mine["min_nodes"] == 2 and mine["max_nodes"] == 2

    proc = gelastic("nodes", cluster=shared)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].split()[:3] == ["NODE", "ADDR", "STATE"]
    assert {line.split()[0] for line in proc.stdout.splitlines()[1:]} == {"node-0", "node-1"}
    nodes = parse_json(gelastic("nodes", "--json", cluster=shared))
    assert {n["name"] for n in nodes} == {"node-0", "node-1"}
    assert all(n["slots"] == 2 and n["state"] == "live" for n in nodes)

    proc = gelastic("status", job_id, cluster=shared)
    assert proc.returncode == 0, proc.stderr
    assert "state:     SUCCEEDED" in proc.stdout
    rank_rows = proc.stdout.split("ranks:")[1].strip().splitlines()[1:]
    assert sorted(int(r.split()[0]) for r in rank_rows) == [0, 1, 2, 3]
    status = parse_json(gelastic("status", job_id, "--json", cluster=shared))
    assert status["job_id"] == job_id and status["state"] == "SUCCEEDED"
    assert status["world_size"] == 4
    assert sorted(m["group_rank"] for m in status["members"]) == [0, 1]
    assert sorted(w["global_rank"] for w in status["workers"]) == [0, 1, 2, 3]
    assert all(w["node"] in ("node-0", "node-1") for w in status["workers"])

    proc = gelastic("result", job_id, cluster=shared)
    assert proc.returncode == 0, proc.stderr
    assert "SUCCEEDED" in proc.stdout
    result = parse_json(gelastic("result", job_id, "--json", cluster=shared))
    assert result["finished"] and result["state"] == "SUCCEEDED"
    assert result["result"]["failures"] == {} and result["root_cause"] is None

    proc = gelastic("events", job_id, cluster=shared)
    assert proc.returncode == 0, proc.stderr
    kinds = [line.split()[2] for line in proc.stdout.splitlines()[1:]]
    assert kinds[0] == "submitted" and "finished" in kinds
    events = parse_json(gelastic("events", job_id, "--json", cluster=shared))
    assert [e["kind"] for e in events] == kinds
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and all(e["job_id"] == job_id for e in events)
    later = parse_json(
        gelastic("events", job_id, "--json", "--after", str(seqs[0]), cluster=shared)
    )
    assert [e["seq"] for e in later] == seqs[1:]
    # Following a finished job prints its timeline and returns.
    proc = gelastic("events", job_id, "--follow", "--json", cluster=shared)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["seq"] for line in proc.stdout.splitlines()] == seqs

    for rank in range(4):
        proc = gelastic("logs", job_id, "--rank", str(rank), cluster=shared)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == f"hello from rank {rank}\n"
    proc = gelastic(
        "logs", job_id, "--rank", "2", "--stream", "stderr", "--attempt", "0", cluster=shared
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "note from rank 2\n"


def test_submit_watch_a_function_prints_its_return_values(shared: LocalCluster) -> None:
    proc = gelastic(
        "submit",
        "--nproc-per-node",
        "2",
        "--watch",
        "--json",
        "--",
        "operator:add",
        "1",
        "2",
        cluster=shared,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr
    out = parse_json(proc)
    assert out["state"] == "SUCCEEDED"
    # operator.add("1", "2") on every rank: a JSON value, decoded by the CLI.
    assert out["result"]["return_values"] == {"0": "12", "1": "12"}
    # Another process has no key: JSON values are data, shown without being asked.
    proc = gelastic("result", out["job_id"], cluster=shared)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0: '12'" in proc.stdout and "rank 1: '12'" in proc.stdout
    assert "--trusted-load" not in proc.stdout and "warning" not in proc.stderr
    # A value JSON cannot carry (a tuple) stays an unloaded pickle unless told otherwise.
    proc = gelastic(
        "submit", "--watch", "--json", "--", "builtins:tuple", "ab", cluster=shared, timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stderr
    out = parse_json(proc)
    assert out["result"]["return_values"]["0"].startswith("<PickledReturnValue of rank 0: ")
    proc = gelastic("result", out["job_id"], cluster=shared)
    assert proc.returncode == 0, proc.stderr
    assert "--trusted-load" in proc.stdout and "('a', 'b')" not in proc.stdout
    assert re.search(r"rank 0: <PickledReturnValue of rank 0: \d+ bytes", proc.stdout)
    proc = gelastic("result", "--trusted-load", out["job_id"], cluster=shared)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0: ('a', 'b')" in proc.stdout
    assert "warning" in proc.stderr


def test_submit_module_runs_python_dash_m(shared: LocalCluster) -> None:
    proc = gelastic(
        "submit",
        "--watch",
        "--python",
        PY,
        "-m",
        "platform",
        "--terse",
        cluster=shared,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.splitlines()[0]
    logs = gelastic("logs", job_id, cluster=shared)
    assert logs.returncode == 0 and "Linux" in logs.stdout, logs.stdout


def test_submit_watch_of_a_failing_job_exits_1_with_the_report(
    shared: LocalCluster, tmp_path: Path
) -> None:
    proc = gelastic(
        "submit",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--watch",
        "--env",
        "FAIL_RANK=1",
        "--env",
        "FAIL_CODE=3",
        "--env",
        "SLEEP=120",
        "--stop-grace",
        "5",
        "--",
        PY,
        script("exit_code.py"),
        cluster=shared,
        timeout=TIMEOUT,
        env={"TORCHELASTIC_ERROR_FILE": str(tmp_path / "watch.json")},
    )
    assert proc.returncode == 1, proc.stderr
    job_id = proc.stdout.splitlines()[0]
    assert "Root Cause" in proc.stdout and "exitcode  : 3" in proc.stdout
    assert job_id in proc.stderr  # the progress lines
    # The root cause, where a scheduler reads it (rank 1 left no error file: exit code 3).
    watched = torch_errors.ProcessFailure(0, 1, 3, str(tmp_path / "watch.json"))
    message: Any = watched.message  # torch types it str; the nested format makes it a dict
    assert "exit code 3" in message["message"], message

    proc = gelastic(
        "result",
        job_id,
        cluster=shared,
        env={"TORCHELASTIC_ERROR_FILE": str(tmp_path / "result.json")},
    )
    assert proc.returncode == 1
    assert json.loads((tmp_path / "result.json").read_text()) == watched.error_file_data
    assert proc.stdout.index("Root Cause") < proc.stdout.index("rank      : 1")
    result = parse_json(gelastic("result", job_id, "--json", cluster=shared))
    assert result["state"] == "FAILED"
    assert result["root_cause"]["global_rank"] == 1 and result["root_cause"]["exitcode"] == 3
    assert set(result["result"]["failures"]) == {"1"}


def test_cancel_a_sleeping_job(shared: LocalCluster) -> None:
    job_id = submit(
        shared,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--stop-grace",
        "5",
        "--",
        PY,
        script("cli_sleep.py"),
    )
    job = shared.client.job(job_id)
    poll_until(lambda: job.status().state == JobState.RUNNING, TIMEOUT, what="the job to run")

    proc = gelastic("result", job_id, cluster=shared)
    assert proc.returncode == 2
    assert one_line_error(proc) == f"gelastic: job {job_id} is still RUNNING"

    with subprocess.Popen(
        [
            PY,
            "-m",
            "gelastic",
            "--coordinator",
            shared.address,
            "events",
            job_id,
            "--follow",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, **shared.client_env},
    ) as follow:
        proc = gelastic("cancel", job_id, "--wait", cluster=shared, timeout=TIMEOUT)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"{job_id} CANCELED"
        out, err = follow.communicate(timeout=CALL_TIMEOUT)
    assert follow.returncode == 0, err
    followed = [json.loads(line) for line in out.splitlines()]
    assert followed[0]["kind"] == "submitted" and followed[-1]["kind"] == "finished"

    proc = gelastic("result", job_id, cluster=shared)
    assert proc.returncode == 1
    assert "CANCELED" in proc.stdout
    assert parse_json(gelastic("status", job_id, "--json", cluster=shared))["state"] == "CANCELED"


# ---- gelastic run ---------------------------------------------------------------------------


def run_env(marker: str, tmp_path: Path) -> dict[str, str]:
    # A private TMPDIR shows what `gelastic run` leaves in the temp directory.
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return {**os.environ, MARKER_ENV: marker, "TMPDIR": str(tmp)}


def run_cli(
    *args: str, marker: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "gelastic", "run", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**run_env(marker, cwd), **(env or {})},
        cwd=cwd,
    )


def test_run_a_torchrun_script_on_two_processes(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    proc = run_cli(
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "1",
        "--rdzv-backend=c10d",
        script("cli_torchrun_ok.py"),
        marker=marker,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "[0]:rank 0 of 2 local 0 sum 1.0" in lines, proc.stdout
    assert "[1]:rank 1 of 2 local 1 sum 1.0" in lines, proc.stdout
    notes = [line for line in proc.stderr.splitlines() if "ignoring" in line]
    assert sorted(n.split(":")[1].split()[-1] for n in notes) == [
        "--monitor-interval",
        "--rdzv-backend",
    ]
    assert_nothing_left(marker)
    assert list((tmp_path / "tmp").iterdir()) == []  # the logs of a run that succeeded are gone


def test_run_no_python_program(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    proc = run_cli(
        "--nproc_per_node=2",
        "--no-python",
        "/bin/sh",
        "-c",
        "echo hi $RANK",
        marker=marker,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[0]:hi 0", "[1]:hi 1"]
    assert_nothing_left(marker)


def test_run_a_failing_torchrun_script_exits_1_with_the_report(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    # What a scheduler (TorchX, Kubeflow) sets for torchrun: the root cause must land there.
    scheduler_dir = tmp_path / "scheduler"
    scheduler_dir.mkdir(mode=0o700)
    scheduler_file = scheduler_dir / "error.json"
    proc = run_cli(
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(tmp_path / "logs"),
        "--shutdown-timeout",
        "5",
        script("cli_torchrun_fail.py"),
        marker=marker,
        cwd=tmp_path,
        env={"TORCHELASTIC_ERROR_FILE": str(scheduler_file)},
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    err = proc.stderr
    assert "cli_torchrun_fail.py FAILED" in err
    root = err[err.index("Root Cause") :]
    assert "rank      : 1 (local_rank: 1)" in root.split("Other Failures")[0]
    assert "ValueError: boom from rank 1" in root
    assert "[1]:" in proc.stderr  # rank 1's traceback, teed with its prefix
    assert (tmp_path / "logs").is_dir()
    assert_nothing_left(marker)
    # torch's reader takes the file as a child's error file; it is rank 1's, with its exit code.
    assert scheduler_file.stat().st_mode & 0o777 == 0o600
    data = json.loads(scheduler_file.read_text())
    assert data["message"]["message"] == "ValueError: boom from rank 1"
    assert data["message"]["errorCode"] == 1
    assert 'raise ValueError("boom from rank 1")' in data["message"]["extraInfo"]["py_callstack"]
    read = torch_errors.ProcessFailure(
        local_rank=0, pid=1, exitcode=1, error_file=str(scheduler_file)
    )
    assert read.message == data["message"]
    assert abs(read.timestamp - time.time()) < TIMEOUT
    assert [p.name for p in scheduler_dir.iterdir()] == ["error.json"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_run_stops_everything_on_a_signal(tmp_path: Path, sig: signal.Signals) -> None:
    marker = uuid.uuid4().hex
    out_path = tmp_path / "out.txt"
    env = run_env(marker, tmp_path)
    with (
        open(out_path, "wb") as out,
        subprocess.Popen(
            [
                PY,
                "-m",
                "gelastic",
                "run",
                "--nproc-per-node",
                "2",
                "--shutdown-timeout",
                "5",
                script("cli_sleep.py"),
            ],
            stdout=out,
            stderr=subprocess.PIPE,
            env=env,
            cwd=tmp_path,
        ) as proc,
    ):
        try:
            poll_until(
                lambda: out_path.read_text().count("started rank") == 2 or proc.poll() is not None,
                TIMEOUT,
                what="both workers to start",
            )
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 1, err
    assert f"{sig.name}: cancelling the job" in err.decode()
    assert f"worker logs are in {tmp_path / 'tmp'}" in err.decode()
    assert_nothing_left(marker)
