"""What every benchmark scenario shares: measurements and their statistics, the results table
and JSON, the worker's timestamp files, a gelastic LocalCluster and a group of torchrun launchers.

All times are wall-clock seconds (`time.time()`), because the worker-side timestamps are, and
every process runs on this host: differences between them are meaningful.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import psutil

from client import Job, RunResult
from gelastic.local import LocalCluster, poll_until

__all__ = [
    "GELASTIC",
    "PY",
    "TORCH",
    "TORCHRUN",
    "WORKER",
    "Measurement",
    "RunDirs",
    "Stamp",
    "TorchrunGroup",
    "free_port",
    "gelastic_cluster",
    "log",
    "poll_result",
    "ratios",
    "read_event",
    "read_starts",
    "render_table",
    "wait_starts",
    "worker_env",
    "write_event",
    "write_json",
]

PY = sys.executable
WORKER = str(Path(__file__).resolve().parent / "_worker.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
GELASTIC = "gelastic"
TORCH = "torchrun"
MARK_ENV = "GELASTIC_BENCH_MARK"
"""Set on every torchrun launcher (workers inherit it): finds whatever a group left behind."""


# ---- measurements ----------------------------------------------------------------------------


@dataclass
class Measurement:
    """Samples of one metric of one scenario on one system, in seconds.

    `timeouts` counts runs where the awaited thing never happened within the run's deadline;
    they are not samples.
    """

    scenario: str
    metric: str
    system: str
    values: list[float] = field(default_factory=list)
    timeouts: int = 0
    note: str = ""

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    @property
    def min(self) -> float | None:
        return min(self.values) if self.values else None

    @property
    def max(self) -> float | None:
        return max(self.values) if self.values else None

    def add(self, value: float | None) -> None:
        """Record one run: a value, or None when it timed out."""
        if value is None:
            self.timeouts += 1
        else:
            self.values.append(value)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(n=self.n, median=self.median, min=self.min, max=self.max)
        return out


def ratios(measurements: Sequence[Measurement]) -> list[tuple[str, str, float]]:
    """(scenario, metric, torchrun median / gelastic median) wherever both systems have one."""
    by_key: dict[tuple[str, str], dict[str, Measurement]] = {}
    for m in measurements:
        by_key.setdefault((m.scenario, m.metric), {})[m.system] = m
    out = []
    for (scenario, metric), systems in by_key.items():
        g, t = systems.get(GELASTIC), systems.get(TORCH)
        if g is None or t is None or not g.median or t.median is None:
            continue
        out.append((scenario, metric, t.median / g.median))
    return out


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def render_table(measurements: Sequence[Measurement]) -> str:
    """The results as a plain-text table, followed by the torchrun/gelastic ratios."""
    header = ("scenario", "metric", "system", "median s", "min s", "max s", "n")
    rows = []
    for m in measurements:
        n = str(m.n) + (f" (+{m.timeouts} timed out)" if m.timeouts else "")
        rows.append((m.scenario, m.metric, m.system, _fmt(m.median), _fmt(m.min), _fmt(m.max), n))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {3, 4, 5}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    rs = ratios(measurements)
    if rs:
        out.append("")
        out.append("torchrun / gelastic (ratio of medians):")
        for scenario, metric, r in rs:
            out.append(f"  {scenario} / {metric}: {r:.1f}x")
    notes = [(m.scenario, m.metric, m.system, m.note) for m in measurements if m.note]
    if notes:
        out.append("")
        out.append("notes:")
        for scenario, metric, system, note in notes:
            out.append(f"  {scenario} / {metric} / {system}: {note}")
    return "\n".join(out)


def write_json(path: Path, measurements: Sequence[Measurement], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": {
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            **meta,
        },
        "measurements": [m.to_json() for m in measurements],
        "ratios": [
            {"scenario": s, "metric": m, "torchrun_over_gelastic": r}
            for s, m, r in ratios(measurements)
        ],
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)


def log(msg: str, out: TextIO | None = None) -> None:
    """Progress on stderr, so stdout carries only the table."""
    print(msg, file=out or sys.stderr, flush=True)


# ---- worker timestamps -----------------------------------------------------------------------


@dataclass(frozen=True)
class Stamp:
    """A worker's start: `t` is the first thing its script did."""

    t: float
    rank: int
    restart: int
    pid: int
    later: bool
    """The crash/kill `event` file already existed: a worker of a later attempt."""


def read_starts(run_dir: Path) -> list[Stamp]:
    stamps = []
    for p in run_dir.glob("start-*.json"):
        d = json.loads(p.read_text())
        stamps.append(Stamp(d["t"], d["rank"], d["restart"], d["pid"], d["later"]))
    return sorted(stamps, key=lambda s: s.t)


def wait_starts(
    run_dir: Path, count: int, timeout: float, *, later: bool = False, alive: Callable[[], bool]
) -> list[Stamp] | None:
    """Wait for `count` start stamps (of later attempts only, with `later`).

    Returns None after `timeout`, or as soon as `alive()` is false and the stamps are not there.
    """
    deadline = time.monotonic() + timeout
    while True:
        stamps = [s for s in read_starts(run_dir) if s.later == later]
        if len(stamps) >= count:
            return stamps
        if time.monotonic() >= deadline or not alive():
            return None
        time.sleep(0.02)


def read_event(run_dir: Path) -> float | None:
    p = run_dir / "event"
    return float(json.loads(p.read_text())["t"]) if p.exists() else None


def write_event(run_dir: Path) -> float:
    """Record the benchmark's own crash event (an agent kill) the way the worker does."""
    t = time.time()
    tmp = run_dir / "event.bench.tmp"
    tmp.write_text(json.dumps({"t": t, "rank": -1}))
    tmp.replace(run_dir / "event")
    return t


class RunDirs:
    """Fresh, empty directories for the runs of a scenario, removed on close."""

    def __init__(self, prefix: str) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"gelastic-bench-{prefix}-"))
        self._n = 0

    def new(self, label: str) -> Path:
        self._n += 1
        d = self.root / f"{self._n:03d}-{label}"
        d.mkdir()
        return d

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> RunDirs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def worker_env(run_dir: Path, mode: str, **extra: str) -> dict[str, str]:
    env = {"BENCH_DIR": str(run_dir), "BENCH_MODE": mode, "BENCH_HOLD_MAX": "120"}
    env.update(extra)
    return env


# ---- gelastic ---------------------------------------------------------------------------------


@contextlib.contextmanager
def gelastic_cluster(nodes: int, slots: int = 2) -> Iterator[LocalCluster]:
    """A LocalCluster (lease 3 s, heartbeat 0.5 s), stopped and checked for leftovers.

    Its coordinator quarantines no node as flaky (`--flaky-rounds 0`): a scenario fails the
    same rank on the same node on purpose, run after run, and the quarantine would rightly
    take that node out after three; what is measured is recovery, as torchrun has it.
    """
    cluster = LocalCluster(
        nodes=nodes,
        slots=slots,
        lease=3.0,
        heartbeat_interval=0.5,
        coordinator_args=["--flaky-rounds", "0"],
    )
    try:
        cluster.start()
        yield cluster
    finally:
        warn_leftovers(cluster.stop())
        shutil.rmtree(cluster.workdir, ignore_errors=True)


def warn_leftovers(killed: Sequence[object]) -> None:
    """Say what a cluster's stop had to SIGKILL: a process that outlived a graceful stop."""
    if killed:
        log("warning: the local cluster left processes behind: " + "; ".join(map(str, killed)))


def poll_result(job: Job, timeout: float, interval: float = 0.01) -> tuple[RunResult, float]:
    """Poll `job.poll()` tightly; return the RunResult and the wall time it was first seen."""
    deadline = time.monotonic() + timeout
    while True:
        result = job.poll()
        if result is not None:
            return result, time.time()
        if time.monotonic() >= deadline:
            with contextlib.suppress(Exception):
                job.cancel()
            raise TimeoutError(f"job {job.job_id} had no RunResult after {timeout:g} s")
        time.sleep(interval)


# ---- torchrun ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TorchrunGroup:
    """`count` torchrun launchers on 127.0.0.1 sharing one c10d rendezvous: a torchrun "job".

    Each launcher starts in its own session; `stop()` kills their process groups, then anything
    still carrying this group's marker (torchrun starts workers in sessions of their own, so
    a SIGKILLed launcher leaves its workers running).
    """

    def __init__(
        self,
        *,
        count: int,
        nnodes: str,
        nproc_per_node: int,
        max_restarts: int,
        env: dict[str, str],
        log_dir: Path,
        rdzv_conf: str = "",
    ) -> None:
        self.mark = uuid.uuid4().hex
        self.port = free_port()
        self.argv = [
            TORCHRUN,
            "--nnodes", nnodes,
            "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{self.port}",
            "--rdzv-id", f"bench-{self.mark[:12]}",
            "--max-restarts", str(max_restarts),
            *(["--rdzv-conf", rdzv_conf] if rdzv_conf else []),
            WORKER,
        ]  # fmt: skip
        self.count = count
        self.env = {**os.environ, **env, MARK_ENV: self.mark, "OMP_NUM_THREADS": "1"}
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.exit_times: dict[int, float] = {}
        self._logs: list[Any] = []

    def start(self) -> float:
        """Launch every torchrun at once; returns the wall time just before the first launch."""
        t0 = time.time()
        for i in range(self.count):
            log_file = open(self.log_dir / f"torchrun-{i}.log", "wb")  # noqa: SIM115 - closed in stop
            self._logs.append(log_file)
            self.procs.append(
                subprocess.Popen(
                    self.argv,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        return t0

    def poll(self) -> None:
        """Note the wall time each launcher is first seen to have exited."""
        for i, p in enumerate(self.procs):
            if i not in self.exit_times and p.poll() is not None:
                self.exit_times[i] = time.time()

    def running(self) -> list[int]:
        self.poll()
        return [i for i in range(len(self.procs)) if i not in self.exit_times]

    def wait(self, timeout: float, pred: Callable[[TorchrunGroup], bool] | None = None) -> bool:
        """Wait until `pred(self)` (default: every launcher exited); False after `timeout`."""
        check = pred or (lambda g: not g.running())
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if check(self):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def returncodes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def store_host(self) -> int | None:
        """Index of the launcher that serves the rendezvous TCPStore (listens on the port)."""
        for i, p in enumerate(self.procs):
            with contextlib.suppress(psutil.Error):
                for c in psutil.Process(p.pid).net_connections("tcp"):
                    if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port:
                        return i
        return None

    def kill(self, index: int) -> None:
        """SIGKILL one launcher (not its workers: they live in sessions of their own)."""
        p = self.procs[index]
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        self.poll()

    def leftovers(self) -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error):
                if (
                    proc.environ().get(MARK_ENV) == self.mark
                    and proc.status() != psutil.STATUS_ZOMBIE
                ):
                    found.append(proc)
        return found

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the launchers' groups, SIGKILL after `grace`, then sweep by marker; bounded."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for proc in self.leftovers():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(TimeoutError):
            poll_until(lambda: not self.leftovers(), 10, what="torchrun's workers to exit")
        for f in self._logs:
            f.close()
        self._logs.clear()

    def __enter__(self) -> TorchrunGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- torch workers ----------------------------------------------------------------------------

TORCH_WORKER = str(Path(__file__).resolve().parent / "_torch_worker.py")
TORCH_PHASES = ("start", "torch", "ready")
"""The stamps `_torch_worker.py` writes: its first line, torch imported, past init + all_reduce."""
TORCH_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
"""Given to the torch workers of both systems (torchrun sets OMP_NUM_THREADS=1 itself)."""


def read_phase(run_dir: Path, phase: str) -> list[Stamp]:
    """The `phase` stamps (see TORCH_PHASES) of `_torch_worker.py`, oldest first."""
    stamps = []
    for p in run_dir.glob(f"{phase}-*.json"):
        d = json.loads(p.read_text())
        stamps.append(Stamp(d["t"], d["rank"], d["restart"], d["pid"], d["later"]))
    return sorted(stamps, key=lambda s: s.t)


def wait_phase(
    run_dir: Path,
    phase: str,
    count: int,
    timeout: float,
    *,
    later: bool = False,
    alive: Callable[[], bool],
) -> list[Stamp] | None:
    """`wait_starts` for any phase: `count` stamps of `phase` (of later attempts with `later`)."""
    deadline = time.monotonic() + timeout
    while True:
        stamps = [s for s in read_phase(run_dir, phase) if s.later == later]
        if len(stamps) >= count:
            return stamps
        if time.monotonic() >= deadline or not alive():
            return None
        time.sleep(0.02)


def torch_torchrun_group(**kwargs: Any) -> TorchrunGroup:
    """A TorchrunGroup (same arguments) that runs `_torch_worker.py` instead of `_worker.py`."""
    group = TorchrunGroup(**kwargs)
    group.argv[-1] = TORCH_WORKER
    return group


PRELOAD_NA = "n/a: preload not available"


def preload_spec(spec: Any, linger: float = 0.0) -> Any | None:
    """`spec` with `preload=("torch",)` (and `standby_linger=linger` when given), or None when
    this JobSpec has no `preload` field (or no `standby_linger`, when a linger is asked for)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(spec)}
    if "preload" not in names or (linger and "standby_linger" not in names):
        return None
    extra = {"standby_linger": linger} if linger else {}
    return dataclasses.replace(spec, preload=("torch",), **extra)


LARGE_TORCH_RUNS = 3
"""Runs of a torch scenario's 8-worker size at most: 8 torch processes on 2 cores take long."""


def size_runs(runs: int, workers: int) -> int:
    """The runs of a torch scenario at a size of `workers` ranks (`--runs`; at most 3 from 8 on)."""
    return min(runs, LARGE_TORCH_RUNS) if workers >= 8 else runs
