"""torch's own launcher tests (test/distributed/launcher/test_run.py) through `gelastic run`.

The scripts are torch's, unchanged, in tests/workloads/torch_launcher/; each case below names
the test_run.py case it follows. Every run has a timeout and is checked to leave nothing behind.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests._helpers import free_port
from tests.e2e.conftest import MARKER_ENV, PY, assert_nothing_left

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "tests" / "workloads" / "torch_launcher"
TIMEOUT = 90


def _two_cpus() -> Callable[[], None] | None:
    # `cpu`/`auto` count the CPUs this process may use: pin the run to two of them.
    cpus = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def gelastic_run(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, pin: bool = False
) -> subprocess.CompletedProcess[str]:
    marker = uuid.uuid4().hex
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    full = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    full.update(
        {
            MARKER_ENV: marker,
            "TMPDIR": str(tmp),
            "PYTHONPATH": str(REPO),
            # test_script.py asserts the agent hands the parent's env on.
            "TEST_SENTINEL_PARENT": "FOOBAR",
            **(env or {}),
        }
    )
    proc = subprocess.run(
        [PY, "-m", "gelastic", "run", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=full,
        cwd=tmp_path,
        preexec_fn=_two_cpus() if pin else None,
    )
    assert_nothing_left(marker)
    return proc


def touched(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def test_launch_with_env_vars_no_python_shell_script(tmp_path: Path) -> None:
    # test_launch_with_env_vars: PET_NO_PYTHON=1 runs the shell script itself, not `python it`.
    out = tmp_path / "out"
    out.mkdir()
    env = {
        "PET_NNODES": "1",
        "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_ID": uuid.uuid4().hex,
        "PET_MONITOR_INTERVAL": "1",
        "PET_START_METHOD": "spawn",
        "PET_NO_PYTHON": "1",
    }
    proc = gelastic_run(
        tmp_path, str(BIN / "test_script.sh"), str(out), env={**env, "PET_MODULE": "0"}
    )
    assert proc.returncode == 0, proc.stderr
    assert touched(out) == {"0", "1"}


def test_pet_module_runs_a_module(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = gelastic_run(
        tmp_path,
        "--nproc-per-node=2",
        "tests.workloads.torch_launcher.test_script",
        f"--touch_file_dir={out}",
        env={"PET_MODULE": "true", "PET_TEE": "3"},
    )
    assert proc.returncode == 0, proc.stderr
    assert touched(out) == {"0", "1"}
    assert "[0]:TEST_SENTINEL_PARENT = FOOBAR" in proc.stdout.splitlines(), proc.stdout


def test_launch_elastic_one_to_two_nodes_runs_with_one(tmp_path: Path) -> None:
    # test_launch_elastic: --nnodes=1:2 launched on one node runs with that node.
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    proc = gelastic_run(
        tmp_path,
        "--nnodes=1:2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{port}",
        "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'",
        f"--rdzv-id={uuid.uuid4().int}",
        "--monitor-interval=1",
        "--start-method=spawn",
        str(BIN / "test_script.py"),
        f"--touch_file_dir={out}",
    )
    assert proc.returncode == 0, proc.stderr
    assert touched(out) == {"0", "1"}
    # A real c10d rendezvous at the endpoint (this launcher hosts it): one node is enough once
    # the last call (1 s) has passed, as in torch.
    assert "ignoring --rdzv-backend" not in proc.stderr
    assert f"reaches localhost:{port}" in proc.stderr


def test_an_unsupported_flag_is_refused(tmp_path: Path) -> None:
    # Every refusal is in tests/unit/test_run_flags.py; this is the command's exit and message.
    out = tmp_path / "out"
    out.mkdir()
    proc = gelastic_run(
        tmp_path, "--logs-specs", "custom", "--no-python", str(BIN / "test_script.sh"), str(out)
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("gelastic run: --logs-specs is not supported: "), proc.stderr
    assert touched(out) == set()


@pytest.mark.skipif(_two_cpus() is None, reason="needs two CPUs to pin the run to")
def test_nproc_launch_cpu_configuration(tmp_path: Path) -> None:
    # test_nproc_launch_auto_configurations counts the CPUs; `auto` (which imports torch) is
    # checked in tests/unit/test_run_flags.py.
    out = tmp_path / "out"
    out.mkdir()
    proc = gelastic_run(
        tmp_path,
        "--nproc-per-node=cpu",
        "--no-python",
        str(BIN / "test_script.sh"),
        str(out),
        pin=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert touched(out) == {"0", "1"}


def test_a_fixed_master_port_is_the_workers_and_a_taken_one_fails_naming_it(
    tmp_path: Path,
) -> None:
    # test_launch_user_script_python_caffe2_bc: --master-addr/--master-port/--node-rank=0.
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    proc = gelastic_run(
        tmp_path,
        "--nproc-per-node=2",
        "--master-addr=localhost",
        f"--master-port={port}",
        "--node-rank=0",
        str(BIN / "test_script.py"),
        f"--touch_file_dir={out}",
    )
    assert proc.returncode == 0, proc.stderr
    assert touched(out) == {"0", "1"}
    lines = proc.stdout.splitlines()
    assert f"[0]:MASTER_PORT = {port}" in lines and f"[1]:MASTER_PORT = {port}" in lines
    assert "[1]:MASTER_ADDR = localhost" in lines, proc.stdout
    # The same port, taken: the round fails and says which port.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = gelastic_run(
            tmp_path,
            "--nproc-per-node=2",
            f"--master-port={port}",
            str(BIN / "test_script.py"),
            f"--touch_file_dir={out}",
        )
    assert proc.returncode == 1, proc.stderr
    assert f"127.0.0.1:{port}" in proc.stderr, proc.stderr


LEGACY_SCRIPT = """\
import argparse, os, sys
# What a script written for `python -m torch.distributed.launch` (no --use-env) parses.
parser = argparse.ArgumentParser()
parser.add_argument("--local-rank", "--local_rank", type=int, required=True)
parser.add_argument("--lr", type=float)
args = parser.parse_args()
assert args.local_rank == int(os.environ["LOCAL_RANK"]), (args.local_rank, sys.argv)
print("argv", sys.argv[1:])
"""


def test_a_legacy_launch_script_gets_its_local_rank_as_an_argument(tmp_path: Path) -> None:
    # torch.distributed.launch without --use-env: `--local-rank=N` first, then the script's own.
    script = tmp_path / "legacy.py"
    script.write_text(LEGACY_SCRIPT)
    proc = gelastic_run(tmp_path, "--nproc-per-node=2", "--no-use-env", str(script), "--lr", "1")
    assert proc.returncode == 0, proc.stderr
    lines = set(proc.stdout.splitlines())
    for rank in (0, 1):
        assert f"[{rank}]:argv ['--local-rank={rank}', '--lr', '1']" in lines, proc.stdout
    # Without it (torchrun's way, and --use-env) the script gets no such argument.
    proc = gelastic_run(tmp_path, "--use_env", str(script), "--lr", "1")
    assert proc.returncode == 1 and "--local-rank" in proc.stderr, proc.stderr
