"""The workers' c10d store lives outside them: `gelastic run` with real torch (gloo).

A python job's ranks are all TCPStore clients (``TORCHELASTIC_USE_AGENT_STORE=True``) of a store
host that group rank 0's agent runs for the round and stops after the workers, so ranks still
reach the store after rank 0 has exited. The store host goes away with its round, when the job
fails, and when its agent is killed; a job whose python has no torch is not held up by it. Every
run is checked to leave nothing behind, the store host included (each run carries a unique
environment marker the store host inherits too).

There is no "torch's init-method script N times without a failure" test here: that script's rare
SIGABRT at exit is torch's own race in each rank (see tests/workloads/init_method.py), and it
happens with the store outside the workers too.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import uuid
from pathlib import Path

import psutil

from gelastic.local import poll_until
from tests._helpers import gone
from tests.e2e.conftest import MARKER_ENV, PY, assert_nothing_left, script

REPO = Path(__file__).resolve().parents[2]
WORKLOADS = REPO / "tests" / "workloads"
TIMEOUT = 120

_STORE_HOST = re.compile(r"started the c10d store host pid (\d+) for ([^\s]+):(\d+)")


def run_env(tmp: Path, marker: str) -> dict[str, str]:
    (tmp / "tmp").mkdir(parents=True, exist_ok=True)
    return {**os.environ, MARKER_ENV: marker, "TMPDIR": str(tmp / "tmp")}


def run_argv(*args: str) -> list[str]:
    return [PY, "-m", "gelastic", "run", "--log-level", "INFO", "--nproc-per-node", "4", *args]


def run(*args: str, tmp: Path, marker: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        run_argv(*args),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=run_env(tmp, marker),
        cwd=tmp,
    )


def store_host_pid(proc: subprocess.CompletedProcess[str]) -> int:
    found = _STORE_HOST.findall(proc.stderr)
    assert len(found) == 1, proc.stderr
    assert "c10d store serving at" in proc.stderr, proc.stderr
    return int(found[0][0])


def test_the_store_outlives_rank_0(tmp_path: Path) -> None:
    # Rank 0 exits first; the others then set and get keys. With rank 0 hosting the store this
    # fails every time (Broken pipe), so it shows where the store lives, not just that it works.
    # The store host must also have served (not just been started) and be gone afterwards.
    marker = uuid.uuid4().hex
    proc = run(str(WORKLOADS / "rank0_exits_first.py"), tmp=tmp_path, marker=marker)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sorted(line for line in lines if "rank 0" in line) == [
        "[0]:rank 0 leaves",
        "[1]:store outlived rank 0",
        "[2]:store outlived rank 0",
        "[3]:store outlived rank 0",
    ], proc.stdout
    pid = store_host_pid(proc)
    assert_nothing_left(marker)
    assert gone(pid)


def test_a_python_that_cannot_import_torch_runs_without_a_store(tmp_path: Path) -> None:
    # `python -S` has no site-packages, so no torch: the store host cannot serve; the job, which
    # does not use torch, is not held up by it.
    script = tmp_path / "mode.py"
    script.write_text("import os\nprint('mode', os.environ['TORCHELASTIC_USE_AGENT_STORE'])\n")
    marker = uuid.uuid4().hex
    proc = run("--no-python", PY, "-S", str(script), tmp=tmp_path, marker=marker)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("mode True") == 4, proc.stdout
    # The host starts after the workers, so these may be done (and the host stopped) before it
    # says it cannot import torch; what it says then is tested on its own, in
    # tests/service/test_round_store.py.
    assert "c10d store serving at" not in proc.stderr
    assert len(_STORE_HOST.findall(proc.stderr)) == 1, proc.stderr
    assert_nothing_left(marker)


def test_a_failed_job_leaves_no_store_host(tmp_path: Path) -> None:
    # The ranks fail at once, while the store host may still be importing torch.
    marker = uuid.uuid4().hex
    proc = run("--no-python", PY, "-c", "raise SystemExit(3)", tmp=tmp_path, marker=marker)
    assert proc.returncode != 0, proc.stderr
    assert "exitcode  : 3" in proc.stderr, proc.stderr
    pid = int(_STORE_HOST.findall(proc.stderr)[0][0])
    assert_nothing_left(marker)
    assert gone(pid)


def test_the_store_host_dies_with_its_agent(tmp_path: Path) -> None:
    # SIGKILL gives the embedded agent no chance to stop anything: the store host must go by
    # itself (parent-death signal, EOF on its stdin), like the workers.
    marker = uuid.uuid4().hex
    err_path = tmp_path / "stderr.txt"
    with (
        err_path.open("wb") as err,
        subprocess.Popen(
            run_argv(script("cli_sleep.py")),
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=run_env(tmp_path, marker),
            cwd=tmp_path,
        ) as proc,
    ):
        try:
            poll_until(
                lambda: "c10d store serving at" in err_path.read_text() or proc.poll() is not None,
                TIMEOUT,
                what="the store host to serve",
            )
            assert proc.poll() is None, err_path.read_text()
            pid = int(_STORE_HOST.findall(err_path.read_text())[0][0])
            host = psutil.Process(pid)  # kept: is_running() tells a reused pid from the host
            assert host.environ().get(MARKER_ENV) == marker
            proc.send_signal(signal.SIGKILL)
            proc.wait(TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
    # The host goes by its own parent-death signal and stdin EOF; on a loaded host its
    # interpreter (with torch loaded) takes a while to end, so wait for it, bounded.
    poll_until(
        lambda: not host.is_running() or host.status() == psutil.STATUS_ZOMBIE,
        30,
        what="the store host to die with its agent",
    )
    assert_nothing_left(marker)
