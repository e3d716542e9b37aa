"""WorkerGroup with real, short-lived worker processes: exits, failures, stop, watchdog, health.

Every test checks that no process it started is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from client.assignment import RoundAssignment, WorkerRanks
from client.errors import NO_ERROR_FILE_MESSAGE
from client.model import MAX_RETURN_VALUE_BYTES, FailureCategory, JobSpec, WorkerState
from client.results import decode
from nodeagent._reaper import reap_previous, record_workers
from nodeagent._sentinel import MARK_ENV
from nodeagent._workers import WorkerExit, WorkerGroup
from tests._helpers import free_port, gone, wait_for

PY = sys.executable
TESTS_DIR = Path(__file__).resolve().parents[1]
DEADLINE = 30.0
TORCH_DEADLINE = 90.0  # a first `import torch` can be slow on a busy machine


async def wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    await wait_for(lambda: all(gone(p) for p in pids), timeout, what=f"pids {pids} to be gone")


class Exits:
    """on_exit collector that tests can wait on."""

    def __init__(self) -> None:
        self.items: list[WorkerExit] = []
        self._changed = asyncio.Event()

    def __call__(self, ex: WorkerExit) -> None:
        self.items.append(ex)
        self._changed.set()

    async def wait(self, n: int, timeout: float = DEADLINE) -> list[WorkerExit]:
        async def until() -> None:
            while len(self.items) < n:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(until(), timeout)
        return sorted(self.items, key=lambda e: e.local_rank)


class Console:
    """Console writer that records what the group forwards."""

    def __init__(self) -> None:
        self.data: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}
        self._changed = asyncio.Event()

    def __call__(self, stream: int, data: bytes) -> None:
        self.data[stream] += data
        self._changed.set()

    def text(self, stream: int) -> str:
        return self.data[stream].decode()

    async def wait_for(self, needle: str, timeout: float = DEADLINE) -> None:
        async def until() -> None:
            while needle not in self.text(1) + self.text(2):
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(until(), timeout)


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.log_root = tmp_path / "logs"
        self.groups: list[WorkerGroup] = []
        self.pids: list[int] = []

    def script(self, name: str, body: str) -> str:
        path = self.tmp / "scripts" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(textwrap.dedent(body))
        return str(path)

    def group(
        self,
        spec: JobSpec,
        *,
        attempt: int = 0,
        round_: int = 0,
        console: Console | None = None,
        **kw: Any,
    ) -> tuple[WorkerGroup, Exits]:
        n = spec.nproc_per_node
        a = RoundAssignment(
            job_id="job1",
            round=round_,
            attempt=attempt,
            spec=spec,
            group_rank=0,
            group_world_size=1,
            master_addr="127.0.0.1",
            master_port=free_port(),  # a python job's store host binds it: one per group
            workers=tuple(WorkerRanks(i, i, i, n, n) for i in range(n)),
            run_id="run1",
        )
        exits = Exits()
        g = WorkerGroup(
            a,
            node_name="node0",
            log_root=self.log_root,
            on_exit=exits,
            console=console if console is not None else Console(),
            run_dir=self.tmp,
            **kw,
        )
        self.groups.append(g)
        return g, exits

    async def start(self, g: WorkerGroup) -> dict[int, int]:
        pids = await g.start()
        self.pids.extend(pids.values())
        return pids


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = Harness(tmp_path)
    yield harness
    for g in harness.groups:
        await asyncio.wait_for(g.close(), DEADLINE)
    await wait_gone(harness.pids)


def log(h: Harness, rank: int, stream: str = "stderr", attempt_dir: str = "attempt_0") -> str:
    return (h.log_root / "job1" / attempt_dir / str(rank) / f"{stream}.log").read_text()


# -- outcomes ----------------------------------------------------------------------------------


async def test_success_env_argv_and_logs(h: Harness) -> None:
    script = h.script(
        "ok.py",
        """
        import json, os, sys
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
                "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "MY_VAR"]
        print(json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv,
                          "path0": sys.path[0], "name": __name__, "cwd": os.getcwd()}))
        print("to stderr", file=sys.stderr)
        """,
    )
    spec = JobSpec(
        entrypoint=[PY, "-u", script],
        args=["a", "--lr=${local_rank}"],
        nproc_per_node=2,
        env={"MY_VAR": "mine"},
        redirects="3",
        cwd=str(h.tmp),
    )
    console = Console()
    g, exits = h.group(spec, console=console)
    pids = await h.start(g)
    assert sorted(pids) == [0, 1] and all(p > 0 for p in pids.values())
    assert g.state in (WorkerState.HEALTHY, WorkerState.SUCCEEDED)
    done = await exits.wait(2)
    assert [(e.exitcode, e.failure, e.stopped_by_agent, e.return_value) for e in done] == [
        (0, None, False, None),
        (0, None, False, None),
    ]
    assert [e.pid for e in done] == [pids[0], pids[1]]
    assert g.state is WorkerState.SUCCEEDED and g.running == 0
    for rank in (0, 1):
        out = json.loads(log(h, rank, "stdout"))
        d = h.log_root / "job1" / "attempt_0" / str(rank)
        assert out["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "TORCHELASTIC_RUN_ID": "run1",
            "TORCHELASTIC_ERROR_FILE": str(d / "error.json"),
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # a python job: its agent hosts the store
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(g.assignment.master_port),
            "OMP_NUM_THREADS": "1",
            "MY_VAR": "mine",
        }
        assert out["argv"] == [script, "a", f"--lr={rank}"]
        assert out["path0"] == str(Path(script).parent)
        assert out["name"] == "__main__"
        assert out["cwd"] == str(h.tmp)
        assert log(h, rank) == "to stderr\n"
        assert not (d / "error.json").exists()
    # redirects=3: nothing on the agent console
    assert console.text(1) == "" and console.text(2) == ""


async def test_exit_code_without_error_file(h: Harness) -> None:
    g, exits = h.group(
        JobSpec(
            entrypoint=[PY, "-c", "import sys; print('bad input', file=sys.stderr); sys.exit(3)"]
        )
    )
    pids = await h.start(g)
    (ex,) = await exits.wait(1)
    f = ex.failure
    assert f is not None and ex.exitcode == 3 and not ex.stopped_by_agent
    # torch's message exactly; gelastic's account of the exit in `detail`, the executable apart.
    assert f.message == NO_ERROR_FILE_MESSAGE
    assert f.detail == f"Process exited with exit code 3 (pid {pids[0]}); no error file was written"
    assert f.executable == PY
    assert f.stderr_tail == "bad input"
    assert f.error_file == "<N/A>" and f.signal == ""
    assert (f.global_rank, f.local_rank, f.node, f.attempt, f.round) == (0, 0, "node0", 0, 0)
    assert g.state is WorkerState.FAILED


async def test_death_by_sigkill(h: Harness) -> None:
    code = (
        "import os, sys; print('about to die', file=sys.stderr, flush=True); "
        "os.kill(os.getpid(), 9)"
    )
    g, exits = h.group(JobSpec(entrypoint=[PY, "-c", code]))
    pids = await h.start(g)
    (ex,) = await exits.wait(1)
    f = ex.failure
    assert f is not None and ex.exitcode == -9
    assert f.message == f"Signal 9 (SIGKILL) received by PID {pids[0]}"
    assert f.signal == "SIGKILL" and f.executable == PY
    assert f.stderr_tail == "about to die"
    assert abs(f.precise_timestamp - ex.timestamp) < 1e-6


async def test_uncaught_exception_without_decorator(h: Harness) -> None:
    script = h.script(
        "boom.py",
        """
        def train(step):
            raise ValueError(f"bad value {step}")

        if __name__ == "__main__":
            train(42)
        """,
    )
    g, exits = h.group(JobSpec(entrypoint=[PY, script]))
    await h.start(g)
    (ex,) = await exits.wait(1)
    f = ex.failure
    assert f is not None and ex.exitcode == 1
    assert (f.message, f.executable) == ("ValueError: bad value 42", PY)
    assert f.traceback.startswith("Traceback (most recent call last):")
    assert f'File "{script}", line 3, in train' in f.traceback
    assert "_bootstrap" not in f.traceback and "runpy" not in f.traceback
    error_file = h.log_root / "job1" / "attempt_0" / "0" / "error.json"
    assert f.error_file == str(error_file)
    extra = json.loads(error_file.read_text())["message"]["extraInfo"]
    # torch's reader int()s "timestamp"; the sub-second time rides in "timestamp_ns".
    assert re.fullmatch(r"\d+", extra["timestamp"])
    assert f.precise_timestamp == int(extra["timestamp_ns"]) / 1e9
    assert int(f.timestamp) == int(extra["timestamp"])
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure as TorchFailure

    theirs = TorchFailure(local_rank=0, pid=ex.pid, exitcode=1, error_file=str(error_file))
    assert theirs.timestamp == int(extra["timestamp"])
    # The printed traceback reads like `python boom.py`.
    stderr = log(h, 0)
    assert stderr.startswith("Traceback (most recent call last):")
    assert "_bootstrap" not in stderr and stderr.rstrip().endswith("ValueError: bad value 42")


async def test_torch_record_writes_the_error_file(h: Harness) -> None:
    script = h.script(
        "recorded.py",
        """
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            raise RuntimeError("raised under torch's @record")

        if __name__ == "__main__":
            main()
        """,
    )
    g, exits = h.group(JobSpec(entrypoint=[PY, script]))
    await h.start(g)
    (ex,) = await exits.wait(1, timeout=TORCH_DEADLINE)
    f = ex.failure
    assert f is not None and ex.exitcode == 1
    assert (f.message, f.executable) == ("RuntimeError: raised under torch's @record", PY)
    assert "raise RuntimeError" in f.traceback
    # torch's own file was kept (ours would add "timestamp_ns").
    error_file = h.log_root / "job1" / "attempt_0" / "0" / "error.json"
    assert set(json.loads(error_file.read_text())["message"]["extraInfo"]) == {
        "py_callstack",
        "timestamp",
    }
    # The file holds whole seconds; the agent refines them with the moment it saw the exit.
    file_ts = int(json.loads(error_file.read_text())["message"]["extraInfo"]["timestamp"])
    assert file_ts <= f.precise_timestamp < file_ts + 2
    assert f.timestamp <= ex.timestamp


ECHO = str(TESTS_DIR / "workloads" / "echo.py")


@pytest.mark.parametrize(
    "command",
    [
        [PY, ECHO, "a", "--b"],
        [PY, "-u", "-m", "workloads.echo", "a", "--b"],
        [
            PY,
            "-c",
            "import sys, workloads.echo as e; "
            "print(e.describe().replace('workloads.echo', sys.argv[1]))",
            "__main__",
        ],
        [PY, "-I", ECHO, "x"],
        [PY, "workloads/echo.py", "relative"],
    ],
)
async def test_python_modes_look_like_plain_python(h: Harness, command: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    plain = await asyncio.to_thread(
        subprocess.run,
        command,
        cwd=TESTS_DIR,
        env=env,
        capture_output=True,
        check=True,
        timeout=DEADLINE,
    )
    g, exits = h.group(JobSpec(entrypoint=command, cwd=str(TESTS_DIR), redirects="3"))
    await h.start(g)
    (ex,) = await exits.wait(1)
    assert ex.failure is None
    assert json.loads(log(h, 0, "stdout")) == json.loads(plain.stdout)


async def test_function_returns_values(h: Harness) -> None:
    key = bytes(range(32))
    spec = JobSpec(
        entrypoint="workloads.functions:return_dict",
        function_args=pickle.dumps(((5,), {"y": 7})),
        nproc_per_node=2,
        cwd=str(TESTS_DIR),
        result_key=key,
    )
    g, exits = h.group(spec)
    await h.start(g)
    done = await exits.wait(2)
    assert [e.failure for e in done] == [None, None]
    values = [
        decode(e.return_value, key=key, job_id="job1", rank=e.global_rank)
        for e in done
        if e.return_value is not None
    ]
    assert values == [{"x": 5, "y": 7, "rank": r, "sum": 12} for r in (0, 1)]


@pytest.mark.parametrize(
    ("function", "args", "exitcode", "message"),
    [
        ("raise_value_error", ("nope",), 1, r"ValueError: nope"),
        (
            "return_unpicklable",
            (),
            1,
            r"return value of workloads\.functions:return_unpicklable cannot be pickled: "
            r"TypeError: cannot pickle '_thread\.lock' object",
        ),
        (
            "return_big",
            (MAX_RETURN_VALUE_BYTES,),
            0,
            r"Process exited with exit code 0 \(pid \d+\), but the return value is \d+ bytes, "
            r"\d+ bytes over the limit of 4194304 bytes",
        ),
        (
            "exit_with",
            (4,),
            4,
            r"Process exited with exit code 4 \(pid \d+\); no error file was written",
        ),
    ],
)
async def test_function_failures(
    h: Harness, function: str, args: tuple[Any, ...], exitcode: int, message: str
) -> None:
    spec = JobSpec(
        entrypoint=f"workloads.functions:{function}",
        function_args=pickle.dumps((args, {})),
        cwd=str(TESTS_DIR),
    )
    g, exits = h.group(spec)
    await h.start(g)
    (ex,) = await exits.wait(1)
    assert ex.exitcode == exitcode and ex.return_value is None
    assert ex.failure is not None
    # The worker's own failure says which executable ran it (not the agent's verdict).
    assert ex.failure.executable == (PY if exitcode else "")
    assert re.fullmatch(message, ex.failure.report_text), ex.failure.report_text


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("", "is empty"),
        ('{"message": {"message": "trunc', "is not valid JSON: Unterminated string"),
        ("[]", "must hold a JSON object, got list"),
        ('{"message": 5}', "'message' must be a string or an object, got int"),
        ('{"other": 1}', "has no 'message' field"),
    ],
)
async def test_malformed_error_file_from_worker(h: Harness, content: str, problem: str) -> None:
    code = (
        "import os, sys; "
        f"open(os.environ['TORCHELASTIC_ERROR_FILE'], 'w').write({content!r}); sys.exit(1)"
    )
    g, exits = h.group(JobSpec(entrypoint=[PY, "-c", code]))
    pids = await h.start(g)
    (ex,) = await exits.wait(1)
    f = ex.failure
    path = h.log_root / "job1" / "attempt_0" / "0" / "error.json"
    assert f is not None and f.error_file == str(path)
    assert f.message == NO_ERROR_FILE_MESSAGE
    assert f.detail.startswith(
        f"Process exited with exit code 1 (pid {pids[0]}); error file {path}"
    )
    assert problem in f.detail


# -- spawn failures ----------------------------------------------------------------------------


async def test_missing_binary(h: Harness) -> None:
    g, exits = h.group(JobSpec(entrypoint=["/nonexistent/trainer", "--x"]))
    assert await h.start(g) == {}
    assert exits.items == []  # reported only after start() returned
    (ex,) = await exits.wait(1)
    assert (ex.exitcode, ex.pid) == (127, 0)
    assert ex.failure is not None
    assert ex.failure.message == (
        "cannot start worker: cannot run '/nonexistent/trainer' on node node0: "
        "no such file (No such file or directory)"
    )
    assert g.state is WorkerState.FAILED


async def test_a_program_not_in_path_names_the_node_and_the_path(h: Harness) -> None:
    # A bare "python" is looked up in the worker's PATH (the agent's, then the spec's env).
    g, exits = h.group(JobSpec(entrypoint=["python", "train.py"], env={"PATH": "/nonexistent"}))
    await h.start(g)
    (ex,) = await exits.wait(1)
    assert ex.exitcode == 127 and ex.failure is not None
    assert ex.failure.message == (
        "cannot start worker: cannot run 'python' on node node0: not found in PATH=/nonexistent"
    )
    long_path = ":".join(f"/nonexistent/{i}" for i in range(2000))
    g2, exits2 = h.group(JobSpec(entrypoint=["no-such-program"], env={"PATH": long_path}))
    await h.start(g2)
    (ex2,) = await exits2.wait(1)
    assert ex2.failure is not None
    assert "not found in PATH=/nonexistent/0:/nonexistent/1:" in ex2.failure.message
    assert ex2.failure.message.endswith("...") and len(ex2.failure.message) < 500


async def test_the_failure_names_the_executable_that_ran(h: Harness) -> None:
    # The job's "python" resolves through PATH: the failure says which one ran, and where.
    bin_dir = h.tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(PY)
    code = "import sys; sys.exit(5)"
    spec = JobSpec(entrypoint=["python", "-c", code], env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    g, exits = h.group(spec)
    await h.start(g)
    (ex,) = await exits.wait(1)
    assert ex.exitcode == 5 and ex.failure is not None
    assert ex.failure.executable == str(bin_dir / "python")


async def test_not_executable_and_bad_cwd(h: Harness) -> None:
    prog = h.tmp / "not-exec.sh"
    prog.write_text("#!/bin/sh\necho hi\n")
    prog.chmod(0o644)
    g, exits = h.group(JobSpec(entrypoint=[str(prog)]))
    await h.start(g)
    (ex,) = await exits.wait(1)
    assert ex.exitcode == 126 and ex.failure is not None
    if os.geteuid() != 0:
        assert ex.failure.message.startswith(
            f"cannot start worker: cannot run '{prog}' on node node0: permission denied"
        )

    g2, exits2 = h.group(JobSpec(entrypoint=["/bin/true"], cwd=str(h.tmp / "no-such-dir")))
    await h.start(g2)
    (ex2,) = await exits2.wait(1)
    assert ex2.exitcode == 126 and ex2.failure is not None
    assert ex2.failure.message.startswith(
        f"cannot start worker: working directory '{h.tmp / 'no-such-dir'}' cannot be used"
    )


async def test_missing_python_script(h: Harness) -> None:
    g, exits = h.group(JobSpec(entrypoint=[PY, str(h.tmp / "missing.py")]))
    await h.start(g)
    (ex,) = await exits.wait(1)
    assert ex.exitcode == 2 and ex.failure is not None
    assert "can't open file" in ex.failure.message and "missing.py" in ex.failure.message


# -- stop --------------------------------------------------------------------------------------


async def test_stop_escalates_to_sigkill(h: Harness) -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(120)"
    )
    console = Console()
    g, exits = h.group(JobSpec(entrypoint=[PY, "-c", code]), console=console)
    pids = await h.start(g)
    await console.wait_for("ready")
    t0 = time.monotonic()
    assert await g.stop(0.5) == []
    assert time.monotonic() - t0 >= 0.5
    (ex,) = exits.items  # reported before stop() returned
    assert (ex.exitcode, ex.stopped_by_agent, ex.failure) == (-9, True, None)
    assert ex.pid == pids[0]
    assert await g.stop(0.5) == []  # idempotent
    assert len(exits.items) == 1
    assert g.state is WorkerState.STOPPED


async def test_a_worker_killed_by_another_while_the_stop_waits_is_a_failure(h: Harness) -> None:
    # The stop has sent SIGTERM (ignored) and waits its grace; someone else SIGKILLs the worker
    # meanwhile. The agent never sent SIGKILL, so this death is the worker's failure, not a stop.
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(120)"
    )
    console = Console()
    g, exits = h.group(JobSpec(entrypoint=[PY, "-c", code]), console=console)
    pids = await h.start(g)
    await console.wait_for("ready")
    stopping = asyncio.ensure_future(g.stop(30.0))
    handle = g._workers[0].handle
    await wait_for(lambda: signal.SIGTERM in handle.signals_sent, DEADLINE, what="the SIGTERM")
    os.kill(pids[0], signal.SIGKILL)
    assert await asyncio.wait_for(stopping, DEADLINE) == []
    (ex,) = exits.items
    assert (ex.exitcode, ex.stopped_by_agent) == (-9, False)
    assert ex.failure is not None and ex.failure.signal == "SIGKILL"


async def test_stop_with_sigterm_and_close_without_stop(h: Harness) -> None:
    console = Console()
    code = "import time; print('up', flush=True); time.sleep(120)"
    g, exits = h.group(JobSpec(entrypoint=[PY, "-c", code], nproc_per_node=2), console=console)
    await h.start(g)
    await console.wait_for("up")
    assert await g.stop(10.0) == []
    assert [(e.exitcode, e.stopped_by_agent) for e in await exits.wait(2)] == [
        (-15, True),
        (-15, True),
    ]
    g2, exits2 = h.group(JobSpec(entrypoint=["sleep", "120"]))
    pids = await h.start(g2)
    await g2.close()
    assert exits2.items[0].stopped_by_agent
    await wait_gone(list(pids.values()))


async def test_stray_children_are_killed_when_the_worker_exits(h: Harness) -> None:
    code = "import subprocess; p = subprocess.Popen(['sleep', '120']); print(p.pid, flush=True)"
    g, exits = h.group(JobSpec(entrypoint=[PY, "-c", code], redirects="3"))
    await h.start(g)
    (ex,) = await exits.wait(1)
    assert ex.exitcode == 0
    child = int(log(h, 0, "stdout").strip())
    h.pids.append(child)
    await wait_gone([child])


# -- console -----------------------------------------------------------------------------------


async def test_tee_prefixes_and_redirect_hides(h: Harness) -> None:
    code = (
        "import os, sys; r = os.environ['LOCAL_RANK']; "
        "print('out', r); print('line1', r, file=sys.stderr); sys.stderr.write('partial ' + r)"
    )
    console = Console()
    spec = JobSpec(entrypoint=[PY, "-c", code], nproc_per_node=3, tee="0:3", redirects="1:3")
    g, exits = h.group(spec, console=console)
    await h.start(g)
    await exits.wait(3)
    assert "[default0]:out 0\n" in console.text(1)
    assert "[default0]:line1 0\n" in console.text(2)
    assert "[default0]:partial 0\n" in console.text(2)
    both = console.text(1) + console.text(2)
    assert " 1" not in both  # local rank 1 is redirected: files only
    # No mask: echoed too (the agent's console is shared by every job), prefixed with job/rank.
    assert "[job1/2]:out 2\n" in console.text(1) and "[default2]" not in both
    assert "[job1/2]:line1 2\n" in console.text(2) and "[job1/2]:partial 2\n" in console.text(2)
    for rank in range(3):
        assert log(h, rank, "stdout") == f"out {rank}\n"
        assert log(h, rank) == f"line1 {rank}\npartial {rank}"


# -- watchdog and health -----------------------------------------------------------------------


async def test_watchdog_kills_a_hung_worker_with_torch_client(h: Harness) -> None:
    script = h.script(
        "hang.py",
        """
        import os, time
        from torch.distributed.elastic.timer import FileTimerClient, configure, expires

        configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
        with expires(after=60, scope="released"):
            pass
        print("armed", flush=True)
        with expires(after=0.5, scope="scopeA"):
            time.sleep(120)
        """,
    )
    g, exits = h.group(JobSpec(entrypoint=[PY, script], watchdog=True))
    pids = await h.start(g)
    fifo = g.timer_file
    assert fifo is not None and fifo.exists()
    (ex,) = await exits.wait(1, timeout=TORCH_DEADLINE)
    f = ex.failure
    assert f is not None and ex.exitcode == -9 and f.signal == "SIGKILL"
    assert re.fullmatch(
        rf"watchdog timer 'scopeA' expired at [\d\- :.]+; killed PID {pids[0]} with SIGKILL",
        f.message,
    ), f.message
    assert "armed" in log(h, 0, "stdout")
    await g.close()
    assert not fifo.exists()


_TORCH_TIMER_HANG = """
import os, sys, time
from torch.distributed.elastic.timer import FileTimerClient, configure, expires

if os.environ["TORCHELASTIC_TIMER_FILE"] != os.environ["EXPECTED_TIMER_FILE"]:
    sys.exit(7)
configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
with expires(after=0.5, scope="overrun"):
    time.sleep(120)
"""


@pytest.mark.parametrize("where", ["agent", "spec"])
async def test_watchdog_serves_the_timer_file_torch_configures(h: Harness, where: str) -> None:
    # torchrun's way: TORCHELASTIC_ENABLE_FILE_TIMER=1 and TORCHELASTIC_TIMER_FILE, set for the
    # agent or in the job's env; the watchdog serves that path, not one of its own.
    timers = h.tmp / "timers"
    timers.mkdir(mode=0o700)
    fifo = timers / "job.fifo"
    torch_env = {"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "TORCHELASTIC_TIMER_FILE": str(fifo)}
    script = h.script("hang_torch_timer.py", _TORCH_TIMER_HANG)
    spec_env = {"EXPECTED_TIMER_FILE": str(fifo), **(torch_env if where == "spec" else {})}
    agent_env = {**os.environ, **(torch_env if where == "agent" else {})}
    g, exits = h.group(JobSpec(entrypoint=[PY, script], env=spec_env), agent_env=agent_env)
    pids = await h.start(g)
    assert g.timer_file == fifo
    (ex,) = await exits.wait(1, timeout=TORCH_DEADLINE)
    f = ex.failure
    assert f is not None and ex.exitcode == -9, (ex, log(h, 0))
    assert re.fullmatch(
        rf"watchdog timer 'overrun' expired at [\d\- :.]+; killed PID {pids[0]} with SIGKILL",
        f.message,
    ), f.message
    await g.close()
    assert not fifo.exists()


async def _refused(h: Harness, path: str, **kw: Any) -> str:
    env = {"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "TORCHELASTIC_TIMER_FILE": path}
    g, exits = h.group(JobSpec(entrypoint=[PY, "-c", "pass"], env=env, nproc_per_node=2), **kw)
    assert await h.start(g) == {}
    found = await exits.wait(2)
    for ex in found:
        assert ex.failure is not None and ex.failure.category is FailureCategory.INPUT
    assert g.timer_file is None
    return found[0].failure.message if found[0].failure is not None else ""


async def test_a_timer_file_that_cannot_be_served_fails_the_job_as_input(h: Harness) -> None:
    private = h.tmp / "private"
    private.mkdir(mode=0o700)
    precious = private / "notes.txt"
    precious.write_text("keep me")
    open_dir = h.tmp / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    link_dir = h.tmp / "link"
    link_dir.symlink_to(private)
    cases = {
        "relative/timer": "must be an absolute path",
        str(h.tmp / "missing" / "timer"): "cannot be used: No such file or directory",
        str(link_dir / "timer"): "is a symlink",
        str(open_dir / "timer"): "is writable by others (mode 777)",
        str(precious): "exists and is not a FIFO",
        "/" + "x" * 2000: "over the limit of 1024",
    }
    for path, problem in cases.items():
        message = await _refused(h, path)
        assert problem in message, (path, message)
    assert precious.read_text() == "keep me"


async def test_two_jobs_cannot_share_one_timer_file(h: Harness) -> None:
    timers = h.tmp / "timers"
    timers.mkdir(mode=0o700)
    fifo = str(timers / "shared.fifo")
    env = {"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "TORCHELASTIC_TIMER_FILE": fifo}
    first, _ = h.group(JobSpec(entrypoint=[PY, "-c", "import time; time.sleep(60)"], env=env))
    await h.start(first)
    assert str(first.timer_file) == fifo
    message = await _refused(h, fifo)
    assert "served for another job on this node" in message
    await first.close()
    assert not Path(fifo).exists()


async def test_stopped_worker_is_unhealthy(h: Harness) -> None:
    code = "import os, signal; print('stopping', flush=True); os.kill(os.getpid(), signal.SIGSTOP)"
    g, exits = h.group(
        JobSpec(entrypoint=[PY, "-c", code], unhealthy_timeout=0.5), health_interval=0.1
    )
    pids = await h.start(g)
    (ex,) = await exits.wait(1)
    f = ex.failure
    assert f is not None and ex.exitcode == -9
    assert re.fullmatch(
        rf"worker is unhealthy: process in state stopped \(T\) for \d+\.\d s, longer than "
        rf"unhealthy_timeout=0.5 s; killed PID {pids[0]} with SIGKILL",
        f.message,
    ), f.message


async def test_health_samples(h: Harness) -> None:
    console = Console()
    g, _ = h.group(
        JobSpec(entrypoint=[PY, "-c", "import time; print('up', flush=True); time.sleep(120)"]),
        console=console,
        health_interval=0.05,
    )
    pids = await h.start(g)
    await console.wait_for("up")

    await wait_for(lambda: bool(g.samples()), DEADLINE, what="a health sample")
    (s,) = g.samples()
    assert (s.local_rank, s.global_rank, s.pid) == (0, 0, pids[0])
    assert s.rss_bytes > 0 and s.status in ("sleeping", "running")


# -- logs and leftovers ------------------------------------------------------------------------


async def test_later_round_of_an_attempt_never_overwrites_logs(h: Harness) -> None:
    for round_ in (0, 1):
        code = f"print('round {round_}')"
        g, exits = h.group(JobSpec(entrypoint=[PY, "-c", code], redirects="3"), round_=round_)
        await h.start(g)
        await exits.wait(1)
    assert log(h, 0, "stdout", "attempt_0") == "round 0\n"
    assert log(h, 0, "stdout", "attempt_0.1") == "round 1\n"


async def test_reap_previous_kills_recorded_workers_only(tmp_path: Path) -> None:
    prefix = "d" * 32 + "."
    victim = subprocess.Popen(
        ["sleep", "120"], start_new_session=True, env={**os.environ, MARK_ENV: f"{prefix}1"}
    )
    # Recorded too, but without the previous agent's mark: a reused pid, never touched.
    bystander = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        pid_file = tmp_path / "pids.json"
        record_workers(pid_file, [victim.pid, bystander.pid], mark_prefix=prefix)
        assert reap_previous(pid_file) == [victim.pid]
        assert await asyncio.to_thread(victim.wait, DEADLINE) == -signal.SIGKILL
        assert bystander.poll() is None
        assert not pid_file.exists()
    finally:
        for p in (victim, bystander):
            if p.poll() is None:
                p.kill()
            p.wait()
