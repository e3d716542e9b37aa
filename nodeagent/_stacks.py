"""The agent reads its own workers' stacks when the coordinator asks (a `StackRequest`).

Only workers this agent started are read: the request names a job round and local ranks, the
pids come from the agent's own worker group. Each read runs `py-spy dump --pid P [--native]` in a
worker thread (never on the event loop), with a timeout and a bound on what it prints. Where
ptrace is refused (another user, no CAP_SYS_PTRACE in a container, kernel.yama.ptrace_scope),
a python worker is sent SIGUSR1 instead: its bootstrap registered faulthandler on it, which
writes every thread's stack to the worker's stderr log; the answer says so, with what it wrote.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from client.node_protocol import NodeMsg, StackReply, StackRequest, WorkerStack
from client.stacks import MAX_STACK_BYTES, MAX_STACK_NOTE, bounded_stack
from nodeagent._launch import BOOTSTRAP_PATH, WorkerLaunch

__all__ = [
    "FALLBACK_SIGNAL",
    "PY_SPY_ENV",
    "StackService",
    "StackTarget",
    "find_py_spy",
    "read_stack",
    "stack_targets",
]

logger = logging.getLogger(__name__)

PY_SPY_ENV = "GELASTIC_PY_SPY"
"""The py-spy program to run (a path); unset: the one installed beside the agent's python, else
the one on PATH."""
FALLBACK_SIGNAL = signal.SIGUSR1
"""What the worker bootstrap registered faulthandler on (nodeagent._bootstrap.main)."""
READS_AT_ONCE = 8
"""py-spy processes one agent runs at once, all requests together."""
REQUESTS_AT_ONCE = 4
"""Stack requests one agent serves at once; more are answered with an error."""
FALLBACK_WAIT_S = 3.0
"""How long the agent waits for faulthandler's output to appear in the worker's log."""
FALLBACK_SETTLED_S = 0.2
"""The log has stopped growing for this long: faulthandler is done writing."""
_OUTPUT_LIMIT = MAX_STACK_BYTES + 1
_REFUSAL = re.compile(
    r"(?is).*(permission denied|operation not permitted|EPERM|ptrace_scope|"
    r"failed to (attach|suspend|open process)|CAP_SYS_PTRACE).*"
)


@dataclass(frozen=True)
class StackTarget:
    """One worker of this agent's to read: its own pid and log, never one from a request."""

    local_rank: int
    pid: int
    stderr_path: Path
    python: bool
    """It runs under the worker bootstrap, so SIGUSR1 makes faulthandler print its stack."""


class _Worker(Protocol):
    launch: WorkerLaunch

    @property
    def pid(self) -> int: ...

    reported: bool


def target_of(w: _Worker) -> StackTarget:
    launch = w.launch
    return StackTarget(launch.local_rank, w.pid, launch.stderr_path, BOOTSTRAP_PATH in launch.argv)


def find_py_spy() -> str | None:
    """The py-spy to run: $GELASTIC_PY_SPY, the one beside this python, or the one on PATH."""
    named = os.environ.get(PY_SPY_ENV, "")
    if named:
        return named
    beside = Path(sys.executable).with_name("py-spy")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def _run_bounded(argv: list[str], timeout: float, limit: int) -> tuple[int | None, bytes]:
    """Run `argv`; (its exit code, the first `limit` bytes it printed, stdout and stderr
    together). The code is None when it ran past `timeout` (its process group is killed)."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        close_fds=True,
    )
    assert proc.stdout is not None
    out = bytearray()
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                proc.stdout.close()
                return None, bytes(out[:limit])
            if not sel.select(left):
                continue
            data = os.read(proc.stdout.fileno(), 65536)
            if not data:
                break
            if len(out) < limit:
                out += data[: limit - len(out)]
    proc.stdout.close()
    try:
        code = proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, bytes(out)
    return code, bytes(out)


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else "no output")[:300]


def read_stack(t: StackTarget, native: bool, timeout: float, py_spy: str | None) -> WorkerStack:
    """One worker's stack by py-spy; faulthandler into its log when ptrace is refused."""
    if py_spy is None:
        return _fallback(t, "py-spy is not installed on this node")
    argv = [py_spy, "dump", "--pid", str(t.pid)] + (["--native"] if native else [])
    try:
        code, out = _run_bounded(argv, timeout, _OUTPUT_LIMIT)
    except OSError as exc:
        return WorkerStack(t.local_rank, t.pid, "error", note=f"cannot run py-spy: {exc}")
    text = out.decode("utf-8", "replace")
    if code == 0:
        return WorkerStack(t.local_rank, t.pid, "ok", bounded_stack(text))
    if code is None:
        return WorkerStack(
            t.local_rank, t.pid, "error", note=f"py-spy did not finish within {timeout:g} s"
        )
    if _REFUSAL.fullmatch(text):
        return _fallback(t, f"ptrace refused ({_first_line(text)})")
    note = f"py-spy failed (exit code {code}): {_first_line(text)}"
    return WorkerStack(t.local_rank, t.pid, "error", note=note[:MAX_STACK_NOTE])


def _fallback(t: StackTarget, head: str) -> WorkerStack:
    """Ask the worker's faulthandler for its stack; it writes it to the worker's stderr log.
    `head` says why py-spy could not read it."""
    if not t.python:
        note = f"{head}; not a python worker started by the bootstrap, so no faulthandler to ask"
        return WorkerStack(t.local_rank, t.pid, "error", note=note[:MAX_STACK_NOTE])
    try:
        before = t.stderr_path.stat().st_size
        os.kill(t.pid, FALLBACK_SIGNAL)
    except OSError as exc:
        note = f"{head}; could not ask the worker's faulthandler: {exc.strerror or exc}"
        return WorkerStack(t.local_rank, t.pid, "error", note=note[:MAX_STACK_NOTE])
    written = _wait_for_growth(t.stderr_path, before, FALLBACK_WAIT_S)
    log = f"the worker's log ({t.stderr_path.name})"
    if written:
        note = f"{head}; the stack was written to {log}, shown here"
        text = _read_span(t.stderr_path, before, MAX_STACK_BYTES)
    else:
        note = f"{head}; the worker was asked to write its stack to {log}, nothing came within "
        note += f"{FALLBACK_WAIT_S:g} s; the log's tail is shown"
        size = t.stderr_path.stat().st_size if t.stderr_path.exists() else 0
        text = _read_span(t.stderr_path, max(0, size - 4096), 4096)
    return WorkerStack(t.local_rank, t.pid, "ptrace_refused", text, note[:MAX_STACK_NOTE])


def _wait_for_growth(path: Path, before: int, bound: float) -> bool:
    """Whether `path` grew past `before` and then stopped growing, within `bound` seconds."""
    deadline = time.monotonic() + bound
    last, settled_at = before, 0.0
    while time.monotonic() < deadline:
        size = path.stat().st_size if path.exists() else 0
        now = time.monotonic()
        if size != last:
            last, settled_at = size, now
        elif size > before and now - settled_at >= FALLBACK_SETTLED_S:
            return True
        time.sleep(0.05)
    return last > before


def _read_span(path: Path, offset: int, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit + 1)
    except OSError:
        return ""
    return bounded_stack(data.decode("utf-8", "replace"), limit)


class StackService:
    """The stack requests of the agent's session, each served off the event loop."""

    def __init__(
        self,
        node: str,
        workers_of: Callable[[str, int], list[StackTarget] | None],
        tell: Callable[[NodeMsg], None],
        spawn: Callable[[Coroutine[Any, Any, None], str], None],
        py_spy: Callable[[], str | None] = find_py_spy,
    ) -> None:
        self.node = node
        self._workers_of = workers_of
        """(job id, round) -> the running workers of that round here; None: no such round."""
        self._tell = tell
        self._spawn = spawn
        self._py_spy = py_spy
        self._reads = asyncio.Semaphore(READS_AT_ONCE)
        self.serving = 0

    def start(self, m: StackRequest) -> None:
        try:
            self._start(m)
        except Exception:
            # A request must never end the session: it is answered with what went wrong.
            logger.exception("cannot serve stack request for job %s", m.job_id)
            self._tell(StackReply(m.request_id, error=f"node {self.node} failed to read stacks"))

    def _start(self, m: StackRequest) -> None:
        workers = self._workers_of(m.job_id, m.round)
        if workers is None:
            error = f"node {self.node} runs no round {m.round} of job {m.job_id}"
            self._tell(StackReply(m.request_id, error=error[:MAX_STACK_NOTE]))
            return
        if self.serving >= REQUESTS_AT_ONCE:
            error = f"node {self.node} already serves {REQUESTS_AT_ONCE} stack requests"
            self._tell(StackReply(m.request_id, error=error))
            return
        asked = set(m.local_ranks)
        targets = [t for t in workers if not asked or t.local_rank in asked]
        self.serving += 1
        self._spawn(self._serve(m, targets), f"stacks-{m.request_id}")

    async def _serve(self, m: StackRequest, targets: list[StackTarget]) -> None:
        try:
            py_spy = self._py_spy()

            async def one(t: StackTarget) -> WorkerStack:
                async with self._reads:
                    return await asyncio.to_thread(read_stack, t, m.native, m.timeout, py_spy)

            stacks = await asyncio.gather(*(one(t) for t in targets))
            self._tell(StackReply(m.request_id, tuple(stacks)))
        finally:
            self.serving -= 1


def stack_targets(
    held: Mapping[tuple[str, int], Any], job_id: str, round_: int
) -> list[StackTarget] | None:
    """The workers of that round here that still run (started, exit not reported), as stack
    targets; None when the agent holds no such round."""
    h = held.get((job_id, round_))
    if h is None or h.group is None:
        return None
    workers: list[_Worker] = h.group.stack_workers
    return [target_of(w) for w in workers if w.pid and not w.reported]
