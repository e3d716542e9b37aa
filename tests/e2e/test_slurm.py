"""`gelastic run` under a real Slurm: `srun -N1 -n2` starts two launchers on this host, each a
node of one job (named `<hostname>-<SLURM_PROCID>`), the one that can bind the c10d endpoint
embedding the coordinator. The job succeeds with ranks 0 and 1 of 2 (stdlib and torch gloo), and
`scancel` of the running step (or of its job) ends every launcher and every worker; where Slurm
sends SIGTERM rather than SIGKILL, the launchers' own stop (SIGTERM, grace, SIGKILL) does it.

The module's private Slurm (tests/_slurm.py) is started once and stopped at the end even when a
test fails; without Slurm the tests skip, and under CI they fail.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gelastic.local import poll_until
from tests._slurm import KILL_WAIT_S, SlurmCluster, free_port, private_slurm
from tests.e2e.conftest import MARKER_ENV, assert_nothing_left, gone, marked_processes

GELASTIC = Path(sys.executable).parent / "gelastic"
"""The launcher every Slurm task runs: the virtualenv's `gelastic` script."""
TIMEOUT = 120.0

RANKS_SCRIPT = """\
import os

print(f"RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']}", flush=True)
"""

GLOO_SCRIPT = """\
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"gloo rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item()}", flush=True)
dist.destroy_process_group()
"""

# Ignores SIGTERM, so only its launcher's SIGKILL after the grace ends it (or Slurm's SIGKILL).
SLEEP_SCRIPT = """\
import os
import signal
import time
from pathlib import Path

signal.signal(signal.SIGTERM, signal.SIG_IGN)
pid_dir = Path(os.environ["PID_DIR"])
tmp = pid_dir / f".{os.environ['RANK']}.pid"
tmp.write_text(str(os.getpid()))
tmp.rename(pid_dir / f"{os.environ['RANK']}.pid")
print(f"started rank {os.environ['RANK']}", flush=True)
time.sleep(300)
"""

STOP_GRACE_S = 3
"""The launchers' --shutdown-timeout in the scancel tests: SIGTERM to their workers, then this
long, then SIGKILL."""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The module's private Slurm, stopped (and checked) when the module ends."""
    with private_slurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture
def marker() -> Iterator[str]:
    """The run's MARKER_ENV value; what a failed test left with it is killed afterwards (a
    test that passed has checked that nothing was)."""
    value = uuid.uuid4().hex
    yield value
    for p in marked_processes(value):
        with contextlib.suppress(psutil.Error):
            p.kill()


def write_script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def srun_argv(script: Path, rdzv_id: str, *run_args: str) -> list[str]:
    """Two Slurm tasks on the one node, each a `gelastic run` node of one job of two nodes."""
    assert GELASTIC.exists(), f"{GELASTIC} is missing: `make setup` installs it"
    return [
        "srun",
        "-N1",
        "-n2",
        str(GELASTIC),
        "run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        "join_timeout=60",
        *run_args,
        str(script),
    ]


def task_env(slurm: SlurmCluster, marker: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return slurm.env(**{MARKER_ENV: marker, "TMPDIR": str(tmp), **extra})


def srun(
    slurm: SlurmCluster, script: Path, tmp_path: Path, marker: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        srun_argv(script, f"slurm-{marker}"),
        env=task_env(slurm, marker, tmp_path),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def test_srun_two_tasks_are_two_nodes_of_one_job(
    slurm: SlurmCluster, tmp_path: Path, marker: str
) -> None:
    proc = srun(slurm, write_script(tmp_path, "ranks.py", RANKS_SCRIPT), tmp_path, marker)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    seen = sorted(re.findall(r"RANK=(\d+) WORLD_SIZE=(\d+)", proc.stdout))
    assert seen == [("0", "2"), ("1", "2")], (proc.stdout, proc.stderr)
    # Two tasks on one host are two nodes, told apart by SLURM_PROCID.
    for node in (f"{slurm.host}-0", f"{slurm.host}-1"):
        assert re.search(rf"\b{re.escape(node)}\b", proc.stderr), (node, proc.stderr)
    assert_nothing_left(marker)
    poll_until(lambda: slurm.job_ids() == [], 30, what="the job to leave the queue")


def test_srun_two_tasks_all_reduce_over_gloo(
    slurm: SlurmCluster, tmp_path: Path, marker: str
) -> None:
    proc = srun(slurm, write_script(tmp_path, "gloo.py", GLOO_SCRIPT), tmp_path, marker)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    seen = sorted(re.findall(r"gloo rank (\d+) of (\d+) sum (\S+)", proc.stdout))
    assert seen == [("0", "2", "3.0"), ("1", "2", "3.0")], (proc.stdout, proc.stderr)
    assert_nothing_left(marker)


def _step_of(slurm: SlurmCluster, job_name: str) -> str:
    """The one running step (JOBID.STEPID) of the job named `job_name`."""
    lines = slurm.tool("squeue", "-h", "-s", "-o", "%i %j").stdout.splitlines()
    steps = [line.split()[0] for line in lines if line.split()[1:] == [job_name]]
    assert len(steps) == 1, lines
    return steps[0]


def _launchers(marker: str) -> list[psutil.Process]:
    """The Slurm tasks of the marked run: the `gelastic run` processes slurmstepd started."""
    found = []
    for p in marked_processes(marker):
        try:
            parent = p.parent()
            if parent is not None and parent.name().startswith("slurmstepd"):
                found.append(p)
        except psutil.Error:
            continue
    return found


SCANCELS = {
    # Slurm 22.05 SIGKILLs every process of a cancelled step at once: none may escape it.
    "step": lambda step: [step],
    # SIGTERM to every process of the step, and nothing after: the launchers end it all.
    "step-sigterm": lambda step: ["--signal=TERM", step],
    # The job: SIGCONT and SIGTERM to every process, SIGKILL only after KillWait.
    "job": lambda step: [step.split(".")[0]],
}


@pytest.mark.parametrize("how", sorted(SCANCELS))
def test_scancel_of_a_running_step_ends_every_launcher_and_worker(
    slurm: SlurmCluster, tmp_path: Path, marker: str, how: str
) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = write_script(tmp_path, "sleep.py", SLEEP_SCRIPT)
    job_name = f"slurm-{marker}"
    argv = srun_argv(script, job_name, "--shutdown-timeout", str(STOP_GRACE_S))
    argv[1:1] = ["--job-name", job_name]
    out_path, err_path = tmp_path / "srun.out", tmp_path / "srun.err"

    def output() -> tuple[str, str]:
        return out_path.read_text(), err_path.read_text()

    with (
        open(out_path, "wb") as out,
        open(err_path, "wb") as err,
        subprocess.Popen(
            argv,
            env=task_env(slurm, marker, tmp_path, PID_DIR=str(pid_dir)),
            cwd=tmp_path,
            stdout=out,
            stderr=err,
        ) as proc,
    ):
        try:
            poll_until(
                lambda: len(list(pid_dir.glob("[0-9]*.pid"))) == 2 or proc.poll() is not None,
                TIMEOUT,
                what="both workers to write their pids",
            )
            assert proc.poll() is None, output()

            # Before anything is killed: both workers and both launchers run, and are ours.
            workers = {int(p.read_text()) for p in pid_dir.glob("[0-9]*.pid")}
            assert len(workers) == 2
            for pid in workers:
                assert not gone(pid), f"worker {pid} is not running"
                assert psutil.Process(pid).environ().get(MARKER_ENV) == marker
            launchers = _launchers(marker)
            assert len(launchers) == 2, [(p.pid, p.cmdline()) for p in marked_processes(marker)]
            assert sorted(p.environ().get("SLURM_PROCID", "") for p in launchers) == ["0", "1"]
            for launcher in launchers:
                assert str(GELASTIC) in launcher.cmdline(), launcher.cmdline()
            everyone = workers | {p.pid for p in launchers}

            cancelled = time.monotonic()
            slurm.tool("scancel", *SCANCELS[how](_step_of(slurm, job_name)))
            # Half of KillWait: what ends them after a SIGTERM is the launchers' own stop
            # (SIGTERM, the grace, SIGKILL), not Slurm's SIGKILL after KillWait.
            bound = KILL_WAIT_S / 2
            poll_until(
                lambda: all(gone(pid) for pid in everyone),
                bound,
                what=f"every launcher and worker of {sorted(everyone)} to exit",
            )
            proc.wait(timeout=bound)
            ended = time.monotonic() - cancelled
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode != 0, output()
    if how != "step":
        # srun exits with the tasks' highest code, 128 + N for a task killed by signal N: each
        # launcher exited by itself.
        assert 0 < proc.returncode < 128, (proc.returncode, output())
        assert ended >= STOP_GRACE_S  # the workers ignore SIGTERM: they waited out the grace
    assert ended < bound
    assert_nothing_left(marker)
    poll_until(lambda: slurm.job_ids() == [], 30, what="the cancelled job to leave the queue")
