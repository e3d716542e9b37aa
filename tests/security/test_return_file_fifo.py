"""A worker cannot hang its own exit report by leaving a FIFO where its return file goes.

Before the fix the agent opened the return file with a plain blocking open: a FIFO with no writer
kept one of the agent's executor threads in open() forever, and the worker's exit (so the job's
end) was never reported.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re

from client.model import JobSpec
from tests.service.test_workers import TESTS_DIR, Harness, h  # noqa: F401 - h is a fixture

REPORT_DEADLINE = 20.0


def _has_reader(fifo: str) -> bool:
    """Whether some process (a thread of this agent, here) has the FIFO open for reading."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            return False
        raise
    os.close(fd)  # a blocked reader gets end of file and lets go
    return True


async def test_a_fifo_return_file_is_a_failure_not_a_hang(h: Harness) -> None:  # noqa: F811
    spec = JobSpec(
        entrypoint="workloads.functions:return_file_fifo",
        function_args=pickle.dumps(((), {})),
        cwd=str(TESTS_DIR),
    )
    g, exits = h.group(spec)
    await h.start(g)
    fifo = str(h.log_root / "job1" / "attempt_0" / "0" / "return.pkl")
    try:
        (ex,) = await exits.wait(1, timeout=REPORT_DEADLINE)
        assert ex.exitcode == 0 and ex.return_value is None
        assert ex.failure is not None
        assert re.fullmatch(
            r"Process exited with exit code 0 \(pid \d+\), but the return file "
            + re.escape(fifo)
            + " is not a regular file",
            ex.failure.message,
        ), ex.failure.message
        # No thread of the agent is left waiting on the FIFO.
        assert not _has_reader(fifo)
    finally:
        # Frees a reader the old code left blocked, so the test run itself can end.
        with contextlib.suppress(OSError):
            _has_reader(fifo)
