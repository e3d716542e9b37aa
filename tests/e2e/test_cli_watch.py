"""Watching a job from the CLI against real agents: worker output, Ctrl-C, status, lost nodes,
a coordinator restart. One cluster for the module; the restart comes last.

The CLI runs in-process (`cli.main`) where a captured stream will do, and as a subprocess on a
pseudo-terminal where the behaviour is a terminal's (output on by default, Ctrl-C).
"""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import JobSpec, JobState, cli
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, assert_no_leftovers, ctrl_c_as_on_a_terminal

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 90

# Each rank says who it is on both streams; stderr carries an escape sequence (a window title).
HELLO = (
    "import os, sys; r = os.environ['RANK']; print('hello from', r, flush=True); "
    "print('\\x1b]0;pwned\\x07warn from', r, file=sys.stderr, flush=True)"
)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(
        nodes=2,
        slots=2,
        workdir=tmp_path_factory.mktemp("watch-cluster"),
        lease=3.0,
        heartbeat_interval=0.5,
    )
    with c:
        yield c
    assert_no_leftovers(c)


def _main(cluster: LocalCluster, *args: str) -> int:
    return cli.main(["--coordinator", cluster.address, "--token-file", cluster.token_file, *args])


def test_watch_with_logs_all_streams_every_rank_beside_the_progress(
    shared: LocalCluster, capfd: pytest.CaptureFixture[str]
) -> None:
    code = _main(
        shared,
        "submit",
        "--watch",
        "--logs",
        "all",
        "--nnodes",
        "2",
        "--last-call-timeout",
        "2",
        "--",
        PY,
        "-c",
        HELLO,
    )
    out, err = capfd.readouterr()
    assert code == cli.EXIT_OK, err
    job_id = out.splitlines()[0]
    assert "[0]:hello from 0" in out and "[1]:hello from 1" in out
    assert "[0]:" in err and "warn from 1" in err
    progress = [line for line in err.splitlines() if not line.startswith("[0]:")]
    progress = [line for line in progress if not line.startswith("[1]:")]
    # Every progress line names the job; the state is said once per line and the end once.
    assert progress and all(line.startswith(f"[{job_id}] ") for line in progress), err
    assert "rendezvous: rendezvous:" not in err
    assert sum("all workers succeeded" in line for line in progress) == 1, err

    # `gelastic status` of the finished job: how each rank ended, not its last samples.
    assert _main(shared, "status", job_id) == cli.EXIT_OK
    status = capfd.readouterr().out
    ranks = status.split("ranks:")[1].splitlines()[2:]
    assert len(ranks) == 2 and all("exited 0" in r and "running" not in r for r in ranks), status

    # `gelastic logs --all`: every rank, prefixed.
    assert _main(shared, "logs", job_id, "--all") == cli.EXIT_OK
    logs = capfd.readouterr().out
    assert logs.splitlines() == ["[0]:hello from 0", "[1]:hello from 1"]


def _read_until(fd: int, seen: bytearray, want: bytes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while want not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {want!r} within {timeout} s in {bytes(seen)[-2000:]!r}")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the other side closed (EIO on Linux)
                chunk = b""
            if not chunk:
                raise AssertionError(f"output ended without {want!r}: {bytes(seen)[-2000:]!r}")
            seen.extend(chunk)


def test_ctrl_c_on_a_terminal_detaches_and_the_job_runs_on(shared: LocalCluster) -> None:
    master, slave = pty.openpty()
    script = (
        "import os, time\n"
        "print('tick from', os.environ['RANK'], '\\x1b[2J', flush=True)\n"
        "time.sleep(120)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GELASTIC_COORDINATOR"}
    env.update(shared.client_env)
    with ctrl_c_as_on_a_terminal():
        proc = subprocess.Popen(
            [PY, "-m", "gelastic", "submit", "--watch", "--", PY, "-c", script],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
    os.close(slave)
    seen = bytearray()
    job_id = ""
    try:
        # On a terminal rank 0's output is shown by default, without its escape sequence.
        _read_until(master, seen, b"tick from 0", TIMEOUT)
        job_id = bytes(seen).split(b"\r\n", 1)[0].decode().strip()
        assert b"\x1b[2J" not in seen
        proc.send_signal(signal.SIGINT)
        _read_until(master, seen, b"(gelastic cancel " + job_id.encode() + b")", 30)
        assert proc.wait(timeout=30) == 130
        text = bytes(seen).decode(errors="replace")
        assert f"detached; job {job_id} is still running (gelastic cancel {job_id})" in text
        assert shared.client.job(job_id).status().state == JobState.RUNNING
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(master)
        if job_id:
            shared.client.job(job_id).cancel()
            shared.client.job(job_id).wait(60)


def test_a_lost_node_can_be_forgotten_and_a_live_one_cannot(
    shared: LocalCluster, capfd: pytest.CaptureFixture[str]
) -> None:
    shared.start_agent("extra", slots=1)
    shared.kill_agent("extra")
    poll_until(
        lambda: any(n.name == "extra" and n.state == "lost" for n in shared.client.list_nodes()),
        30,
        what="the killed agent to count as lost",
    )
    assert _main(shared, "nodes", "--forget", "node-0") == cli.EXIT_USAGE
    assert "FAILED_PRECONDITION" in capfd.readouterr().err
    assert _main(shared, "nodes", "--forget", "extra") == cli.EXIT_OK
    assert capfd.readouterr().out == "extra: forgotten\n"
    assert _main(shared, "nodes", "--forget", "extra") == cli.EXIT_OK  # idempotent
    assert "extra" not in {n.name for n in shared.client.list_nodes()}


def test_watch_across_a_coordinator_restart_says_re_attaching(
    shared: LocalCluster, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    script = (
        "import os, time\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"  # a gate, not a sleep
    )
    env = {k: v for k, v in os.environ.items() if k != "GELASTIC_COORDINATOR"}
    env.update(shared.client_env)
    proc = subprocess.Popen(
        [PY, "-m", "gelastic", "submit", "--watch", "--nnodes", "2", "--", PY, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        job = shared.client.job(proc.stdout.readline().strip().decode())
        poll_until(
            lambda: sum(1 for w in job.status().workers if w.pid) == 2, TIMEOUT, what="2 ranks"
        )
        shared.kill_coordinator(signal.SIGTERM)
        shared.start_coordinator(port=shared.port)
        poll_until(
            lambda: any(e.kind == "recovered" for e in job.events()), TIMEOUT, what="recovery"
        )
        go.touch()
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    text = err.decode()
    assert proc.returncode == 0, text
    assert f"[{job.job_id}] coordinator restarted; re-attaching" in text, text
    # Nothing says the job lost its nodes or went back to the queue once it ran.
    after_start = text.split("running:", 1)[1]
    assert "node lost" not in text and "queued" not in after_start, text
    assert job.status().attempt == 0  # no worker was restarted


def test_a_cluster_of_its_own_keeps_its_directory_when_a_job_failed(
    capfd: pytest.CaptureFixture[str],
) -> None:
    c = LocalCluster(nodes=1, slots=1)
    with c:
        job = c.client.submit(JobSpec(entrypoint=[PY, "-c", "raise SystemExit(3)"]))
        assert job.wait(TIMEOUT).is_failed()
    try:
        assert c.kept == c.workdir and c.workdir.is_dir()
        assert any(c.agent_log_dir("node-0").rglob("*")), "the worker logs are kept"
        assert f"kept the cluster's directory {c.workdir}" in capfd.readouterr().err
    finally:
        import shutil

        shutil.rmtree(c.workdir, ignore_errors=True)
    assert_no_leftovers(c)
