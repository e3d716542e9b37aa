"""End-to-end fixtures: a real `coordinator serve` and real `nodeagent` processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from gelastic.local import LocalCluster, poll_until
from tests._helpers import gone as gone

SCRIPTS = Path(__file__).resolve().parent / "scripts"
PY = sys.executable


def script(name: str) -> str:
    return str(SCRIPTS / name)


@contextlib.contextmanager
def ctrl_c_as_on_a_terminal() -> Iterator[None]:
    """Processes started inside take SIGINT as a terminal's foreground job does, even when the
    tests run in the background: a shell starts a background job with SIGINT ignored, an ignored
    signal stays ignored across exec, and Python then installs no KeyboardInterrupt. A handled
    one is reset to its default by exec."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def assert_no_leftovers(cluster: LocalCluster) -> None:
    """The stopped cluster had nothing to SIGKILL: every process ended on SIGTERM, every worker
    with its agent. (`stop()` kills what it finds, so looking for live processes afterwards
    would only catch one that survives SIGKILL; that is checked too.)"""
    if cluster.killed:
        raise AssertionError(
            "processes left behind (killed by the cluster's stop):\n"
            + "\n".join(f"  {k}" for k in cluster.killed)
        )
    left = [(p.pid, p.name()) for p in cluster.leftovers()]
    assert not left, f"processes that survived SIGKILL: {left}"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(
        nodes=2, slots=2, workdir=tmp_path / "cluster", lease=3.0, heartbeat_interval=0.5
    )
    with c:
        yield c
    assert_no_leftovers(c)


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """Start a LocalCluster of any size; every one is stopped and checked at the end."""
    started: list[LocalCluster] = []

    def make(nodes: int = 2, slots: int = 2, **kw: Any) -> LocalCluster:
        kw.setdefault("lease", 3.0)
        kw.setdefault("heartbeat_interval", 0.5)
        c = LocalCluster(
            nodes=nodes, slots=slots, workdir=tmp_path / f"cluster{len(started)}", **kw
        )
        started.append(c)
        return c.start()

    yield make
    for c in started:
        c.stop()
    for c in started:
        assert_no_leftovers(c)


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """A directory the workers of a test write what they saw into ($OUT_DIR)."""
    d = tmp_path / "out"
    d.mkdir()
    return d


class Gate:
    """The test's end of crash_once.py's $GATE_DIR: open its gates, read its workers' events.

    Workers wait on a gate instead of sleeping, so a test makes things happen in the order it
    means to check (kill the coordinator, then let a rank crash) rather than hoping a sleep
    was long enough, and the events' times let it assert that order afterwards.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)

    @property
    def env(self) -> dict[str, str]:
        return {"GATE_DIR": str(self.path)}

    def open(self, gate: str) -> float:
        """Let the workers waiting on `gate` go on; returns when it was opened (epoch s)."""
        (self.path / gate).touch()
        return time.time()

    def events(self, event: str | None = None, **match: int | str) -> list[dict[str, Any]]:
        """The events recorded so far (`event` and every `match`ed field equal)."""
        path = self.path / "events.jsonl"
        if not path.exists():
            return []
        found = []
        for line in path.read_text().splitlines():
            if not line.endswith("}"):
                continue  # a line still being written
            e = json.loads(line)
            if (event is None or e["event"] == event) and all(e[k] == v for k, v in match.items()):
                found.append(e)
        return found

    def wait(
        self, event: str, n: int, timeout: float = 60, **match: int | str
    ) -> list[dict[str, Any]]:
        """Wait until `n` matching events were recorded; return them."""
        poll_until(
            lambda: len(self.events(event, **match)) >= n,
            timeout,
            what=f"{n} {event!r} events matching {match}",
        )
        return self.events(event, **match)


@pytest.fixture
def gate(tmp_path: Path) -> Gate:
    """Gates for crash_once.py workers ($GATE_DIR); see Gate."""
    return Gate(tmp_path / "gate")


def wait_started(job: Any, n: int, timeout: float = 60) -> None:
    """Wait until `n` workers of the job have a pid."""
    poll_until(
        lambda: len([w for w in job.status().workers if w.pid]) == n,
        timeout,
        what=f"{n} workers running",
    )


MARKER_ENV = "GELASTIC_RUN_TEST_MARKER"
"""Set in the environment of a `gelastic run` a test starts: its processes carry it."""


def marked_processes(marker: str) -> list[psutil.Process]:
    """The live processes (zombies aside) whose environment carries `marker`."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(MARKER_ENV) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def assert_nothing_left(marker: str) -> None:
    """Every process of a marked `gelastic run` is gone within 15 s (else killed, and fail)."""
    try:
        poll_until(
            lambda: not marked_processes(marker), 15, what="every process of the run to exit"
        )
    except TimeoutError:
        left = [(p.pid, p.name(), p.cmdline()) for p in marked_processes(marker)]
        for p in marked_processes(marker):
            p.kill()
        raise AssertionError(f"processes left behind by gelastic run: {left}") from None
