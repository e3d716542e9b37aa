"""Standby workers end to end: real agents, real torch/gloo, a preloaded job.

A preloaded job whose rank crashes once restarts on the standbys (torch imported before the
round) and trains to the parameters of an undisturbed run; standbys never outlive the job, its
cancel, or their agent's SIGKILL.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import psutil
import torch

from client import JobSpec, WorkerState
from gelastic.local import LocalCluster, poll_until
from nodeagent._launch import BOOTSTRAP_PATH
from tests.e2e.conftest import PY, script

TIMEOUT = 180


def _zygote_procs(tag: str) -> list[psutil.Process]:
    """Live zygotes of the job whose env has STANDBY_TAG=tag, and the processes they forked."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if BOOTSTRAP_PATH not in cmd or "--zygote" not in cmd:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE or p.environ().get("STANDBY_TAG") != tag:
                continue
        except psutil.Error:
            continue
        found.append(p)
    return found


def zygotes(tag: str) -> list[psutil.Process]:
    procs = _zygote_procs(tag)
    pids = {p.pid for p in procs}
    return [p for p in procs if _ppid(p) not in pids]


def standbys(tag: str) -> list[psutil.Process]:
    """Live forks of the job's zygotes: its standbys and the workers that were forked (a fork
    shows its zygote's command line and environment), not its warm store hosts (their stdin is
    the agent's pipe, a worker's is /dev/null)."""
    procs = _zygote_procs(tag)
    pids = {p.pid for p in procs}
    return [p for p in procs if _ppid(p) in pids and _stdin(p) == os.devnull]


def _stdin(p: psutil.Process) -> str:
    try:
        return os.readlink(f"/proc/{p.pid}/fd/0")
    except OSError:
        return ""


def _ppid(p: psutil.Process) -> int:
    try:
        return p.ppid()
    except psutil.Error:
        return 0


def _train(
    c: LocalCluster, tmp: Path, name: str, env: dict[str, str], **kw: Any
) -> tuple[Any, Path]:
    out, ckpt = tmp / f"{name}-out", tmp / f"{name}-ckpt"
    out.mkdir()
    ckpt.mkdir()
    spec = JobSpec(
        entrypoint=[PY, script("standby_train.py")],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"OUT_DIR": str(out), "CKPT_DIR": str(ckpt), "STEPS": "8", "STANDBY_TAG": name, **env},
        stop_grace=5,
        **kw,
    )
    return c.client.submit(spec), out


def test_a_preloaded_job_restarts_on_its_standbys_and_trains_to_the_same_parameters(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    ref_job, ref_out = _train(cluster, tmp_path, "ref", {})
    assert ref_job.wait(TIMEOUT).state == WorkerState.SUCCEEDED
    job, out = _train(
        cluster,
        tmp_path,
        "warm",
        {"CRASH_AT_STEP": "3", "CRASH_RANK": "1", "HOLD_AT_STEP": "2"},
        max_restarts=1,
        preload=("torch",),
    )
    poll_until(lambda: (out / "holding").exists(), 90, what="attempt 0 to hold after step 2")
    # One standby per worker on each node is there before the crash, forked as the workers were.
    poll_until(lambda: len(standbys("warm")) == 8, 60, what="4 workers and 4 standbys")
    (out / "go").touch()
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    starts = sorted(
        tuple(map(int, ln.split()))[:3] for ln in (out / "starts").read_text().splitlines()
    )
    # Attempt 0 forked from the zygotes (torch already imported), attempt 1 on standbys forked
    # from them too; each rank saw its rank and restart count.
    assert starts == [(0, r, 1) for r in range(4)] + [(1, r, 1) for r in range(4)], starts
    resumes = sorted(
        tuple(map(int, ln.split())) for ln in (out / "resumes").read_text().splitlines()
    )
    assert [r for r in resumes if r[0] == 1] == [(1, resumes[-1][1], 4, 3)] * 4
    ref = torch.load(ref_out / "final.pt")
    got = torch.load(out / "final.pt")
    for k in ref:
        assert torch.allclose(ref[k], got[k], atol=1e-5), (k, ref[k], got[k])
    ref_starts = [ln.split() for ln in (ref_out / "starts").read_text().splitlines()]
    assert sorted(s[:3] for s in ref_starts) == [["0", str(r), "0"] for r in range(4)]  # cold
    poll_until(
        lambda: not standbys("warm") and not zygotes("warm"),
        30,
        what="the standbys and zygotes to go with the job",
    )


def test_standbys_go_with_a_cancel_and_with_a_sigkilled_agent(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    def submit(tag: str) -> Any:
        return cluster.client.submit(
            JobSpec(
                entrypoint=[PY, "-c", "import time; time.sleep(600)"],
                nproc_per_node=2,
                min_nodes=2,
                max_nodes=2,
                env={"STANDBY_TAG": tag},
                preload=("json",),
                stop_grace=2,
            )
        )

    job = submit("cancel")
    poll_until(lambda: len(standbys("cancel")) == 8, 60, what="4 workers and 4 standbys")
    job.cancel()
    job.wait(60)
    poll_until(
        lambda: not standbys("cancel") and not zygotes("cancel"),
        30,
        what="the standbys and zygotes to go with the cancel",
    )
    job = submit("kill")
    poll_until(lambda: len(standbys("kill")) == 8, 60, what="4 workers and 4 standbys")
    victim = next(iter(cluster.agents))
    (zygote,) = [z.pid for z in zygotes("kill") if _ppid(z) == cluster.agents[victim].popen.pid]
    theirs = [zygote, *(p.pid for p in standbys("kill") if _ppid(p) == zygote)]
    assert len(theirs) == 5
    cluster.kill_agent(victim, signal.SIGKILL)
    poll_until(
        lambda: not {p.pid for p in [*standbys("kill"), *zygotes("kill")]} & set(theirs),
        30,
        what="the killed agent's zygote, standbys and workers to die with it",
    )
    job.cancel()
    job.wait(60)


_IGNORES_SIGTERM = """
import os, signal, sys, time
out = os.environ["OUT_DIR"]
if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
    sys.exit(0)
if os.environ["RANK"] == "0":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(out, "ignoring"), "w").close()
    time.sleep(600)
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(out, "ignoring")) and time.monotonic() < deadline:
    time.sleep(0.02)
sys.exit(1)
"""


def test_workers_a_restart_replaces_get_the_stop_grace_then_sigkill(
    make_cluster: Any, tmp_path: Path
) -> None:
    c: LocalCluster = make_cluster(nodes=1)
    job = c.client.submit(
        JobSpec(
            entrypoint=[PY, "-c", _IGNORES_SIGTERM],
            nproc_per_node=2,
            max_restarts=1,
            stop_grace=3,
            env={"OUT_DIR": str(tmp_path)},
        )
    )
    result = job.wait(TIMEOUT)
    assert result.state == WorkerState.SUCCEEDED, result.format_failures()
    events = job.events()
    failed = next(e.timestamp for e in events if e.kind == "worker_failed")
    restarted = next(e.timestamp for e in events if e.kind == "workers_started" and e.round > 1)
    # Rank 0 ignores SIGTERM: it has its whole stop_grace (3 s), then SIGKILL, and the restart
    # follows at once.
    assert 3.0 <= restarted - failed < 20, events


_SWEEP_WORKER = """
import os, pathlib, time
out = pathlib.Path(os.environ["OUT_DIR"])
deadline = time.monotonic() + 60
while not (out / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
run = os.environ["TORCHELASTIC_RUN_ID"]
(out / f"{run}-{os.environ['RANK']}").write_text(str(os.getpid()))
"""


def test_a_sweep_runs_on_the_standbys_the_last_job_of_its_spec_left(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    out = tmp_path / "sweep"
    out.mkdir()
    spec = JobSpec(
        entrypoint=[PY, "-c", _SWEEP_WORKER],
        nproc_per_node=2,
        min_nodes=2,
        max_nodes=2,
        env={"OUT_DIR": str(out), "STANDBY_TAG": "sweep"},
        preload=("json",),
        standby_linger=60,
        stop_grace=2,
    )

    first = cluster.client.submit(spec)
    poll_until(lambda: len(standbys("sweep")) == 8, 60, what="4 workers and 4 standbys")
    (out / "go").touch()
    assert first.wait(TIMEOUT).state == WorkerState.SUCCEEDED
    # The job is done; its standbys stay for the next job of the same spec (its workers go).
    poll_until(lambda: len(standbys("sweep")) == 4, 30, what="the first job's workers to go")
    left = {p.pid for p in standbys("sweep")}
    assert len(zygotes("sweep")) == 2
    second = cluster.client.submit(spec)
    assert second.wait(TIMEOUT).state == WorkerState.SUCCEEDED
    ran = {int(f.read_text()) for f in out.iterdir() if f.name.startswith(second.job_id)}
    assert ran == left, (ran, left)  # every rank of the second job was a standby of the first
    # A job of the same launch without a linger takes the second job's standbys and, when it
    # ends, leaves none.
    poll_until(lambda: len(standbys("sweep")) == 4, 60, what="the second job's standbys")
    third = cluster.client.submit(dataclasses.replace(spec, standby_linger=0))
    assert third.wait(TIMEOUT).state == WorkerState.SUCCEEDED
    poll_until(
        lambda: not standbys("sweep") and not zygotes("sweep"),
        30,
        what="no standby or zygote after a job without linger",
    )
