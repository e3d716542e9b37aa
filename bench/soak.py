"""soak: a coordinator over a long run: its memory, its database and Submit latency over time.

`python -m bench soak --minutes N` starts one `coordinator serve` (heartbeat 1 s, lease 10 s,
its SQLite state in the cluster's --state-dir) with `--nodes` simulated nodes (1000;
`_simnodes.py`, in 2 processes of their own, heartbeating with worker health) and two real
`nodeagent`s of 2 slots each. One background job holds every simulated node for the whole run,
as a large training job would; a stream of short jobs (`--rate` per second) runs on the real
agents beside it:

- most exit 0 at once (`/bin/true`, 1-2 nodes x 1-2 workers),
- some fail (`exit 3` after a line on stderr), a few of those with a restart first,
- some sleep until the soak cancels them, queued or running.

Every job must end as its kind says (SUCCEEDED, FAILED, CANCELED) within JOB_DEADLINE_S; one
that does not is cancelled and counted as stuck, loudly. At most MAX_IN_FLIGHT jobs are
unfinished at a time: past that, a submit is skipped and counted (backpressure, not a queue
that grows without end).

Every `--interval` seconds (and once before the first submit) one row: the coordinator's RSS,
the size of its state directory (the SQLite file and its WAL), the p50/p99/max latency of the
Submit calls of that interval, the coordinator's CPU and the host's load meanwhile, the jobs the
coordinator still lists, and the outcomes so far.
The rows go to stderr as they come, into the results JSON (`meta.soak`), and into
`soak.png` (bench/_plots.py) next to it.

`--coordinator-arg ARG` (repeatable) is passed on to `coordinator serve`, so the same soak runs
with any retention setting, e.g. `--coordinator-arg=--retain-jobs=200`; a flag the coordinator
does not know makes it exit at start, and the soak fails with its message.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import statistics
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil

from bench._common import GELASTIC, Measurement, log
from bench._simnodes import SimFleet, cpu_seconds, sim_job_spec, wait_round_started
from client import Client, GelasticError, Job, JobSpec, JobState
from gelastic.local import LocalCluster, poll_until

__all__ = ["Row", "SoakOptions", "SoakReport", "render_rows", "run", "run_soak"]

SCENARIO = "soak"
NODES, QUICK_NODES = 1000, 50
MINUTES, QUICK_MINUTES = 30.0, 0.2
INTERVAL_S, QUICK_INTERVAL_S = 30.0, 4.0
RATE = 4.0
"""Short jobs submitted per second."""
REAL_AGENTS, REAL_SLOTS = 2, 2
HEARTBEAT_S, LEASE_S = 1.0, 10.0
MAX_IN_FLIGHT = 12
"""Three times the real agents' slots: a job waits in the queue for a few others at most, so a
slow host shows as skipped submits, not as jobs that queue past their deadline."""
JOB_DEADLINE_S = 60.0
POLL_S = 0.5
"""How often every unfinished job is asked for its state (GetJob: O(1) on the coordinator)."""
MIX = (("ok", 0.6), ("fail", 0.2), ("cancel", 0.2))
EXPECTED = {"ok": JobState.SUCCEEDED, "fail": JobState.FAILED, "cancel": JobState.CANCELED}
COORDINATOR_DEFAULT_ARGS = ("--log-level", "WARNING", "--flaky-rounds", "0")
"""Before the user's --coordinator-arg (argparse: the last one wins), so they can override it.
No flaky-node quarantine: the "fail" jobs fail on purpose, and one whose first failure reached
the coordinator from one node before the other node's ranks failed counts against that node;
three of those would quarantine one of the soak's two real nodes for an hour, and every job of
two nodes would then wait out its join timeout."""


@dataclass(frozen=True)
class SoakOptions:
    minutes: float = MINUTES
    """Length of the job stream, after the setup."""
    interval: float = INTERVAL_S
    """Seconds between rows."""
    nodes: int = NODES
    """Simulated nodes, all held by the background job."""
    rate: float = RATE
    """Short jobs submitted per second."""
    coordinator_args: tuple[str, ...] = ()
    """Passed on to `coordinator serve` (retention flags, say)."""
    seed: int = 0
    """Seeds the job mix, so two soaks submit the same sequence."""

    def validate(self) -> None:
        for name in ("minutes", "interval", "rate"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"soak: {name} must be a positive number, got {value!r}")
        if self.nodes < 1:
            raise ValueError(f"soak: nodes must be at least 1, got {self.nodes}")


@dataclass(frozen=True)
class Row:
    """One sample of the coordinator, `t_s` seconds after the first submit."""

    t_s: float
    rss_mb: float
    state_mb: float
    """The whole --state-dir: the SQLite file, its WAL and shared-memory file."""
    db_mb: float
    wal_mb: float
    submits: int
    """Submit calls in the interval this row closes."""
    submit_p50_ms: float | None
    submit_p99_ms: float | None
    submit_max_ms: float | None
    coordinator_cpu: float
    """The coordinator's CPU (user + system) over the interval, in cores."""
    load1: float
    """The host's 1-minute load average: on a shared machine, what latency is up against."""
    jobs_listed: int
    """Jobs the coordinator lists (finished ones included): what retention keeps."""
    in_flight: int
    finished: int
    """Jobs seen to end so far, any outcome."""
    unexpected: int
    stuck: int


@dataclass
class SoakReport:
    options: SoakOptions
    rows: list[Row] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    """"kind->STATE" counts, e.g. "ok->SUCCEEDED"; "kind->gone" when retention dropped the job
    before the soak saw it end."""
    skipped: int = 0
    """Submits skipped because MAX_IN_FLIGHT jobs were unfinished."""
    poll_errors: int = 0
    """GetJob calls of the follower that failed (other than NOT_FOUND); asked again."""
    submit_errors: list[str] = field(default_factory=list)
    sim_live: int = 0
    sim_sessions_ended: int = 0
    background_state: str = ""

    def measurements(self) -> list[Measurement]:
        n = self.options.nodes
        rss = Measurement(SCENARIO, f"N={n} coordinator RSS (MB)", GELASTIC)
        state = Measurement(SCENARIO, f"N={n} state dir (MB)", GELASTIC)
        p99 = Measurement(SCENARIO, f"N={n} Submit p99 per interval", GELASTIC)
        for r in self.rows:
            rss.add(r.rss_mb)
            state.add(r.state_mb)
            if r.submit_p99_ms is not None:
                p99.add(r.submit_p99_ms / 1000)
        if self.rows:
            first, last = self.rows[0], self.rows[-1]
            rss.note = (
                f"{first.rss_mb:.0f} -> {last.rss_mb:.0f} MB over {last.t_s / 60:.1f} min; "
                f"{self.summary()}"
            )
            state.note = (
                f"{first.state_mb:.1f} -> {last.state_mb:.1f} MB; jobs listed "
                f"{first.jobs_listed} -> {last.jobs_listed}"
            )
        with_p99 = [r for r in self.rows if r.submit_p99_ms is not None]
        if with_p99:
            p99.note = (
                f"first interval {with_p99[0].submit_p99_ms:.1f} ms, last "
                f"{with_p99[-1].submit_p99_ms:.1f} ms ({self.options.rate:g} submits/s)"
            )
        return [rss, state, p99]

    def summary(self) -> str:
        finished = sum(self.outcomes.values())
        last = self.rows[-1] if self.rows else None
        return (
            f"{finished} jobs finished ({', '.join(f'{k} {v}' for k, v in sorted(self.outcomes.items()))}); "
            f"{last.unexpected if last else 0} unexpected, {last.stuck if last else 0} stuck, "
            f"{self.skipped} submits skipped (in flight >= {MAX_IN_FLIGHT}), {self.poll_errors} "
            f"polls failed; simulated nodes "
            f"{self.sim_live}/{self.options.nodes} live, {self.sim_sessions_ended} sessions "
            f"dropped; background job {self.background_state}"
        )

    def problems(self) -> list[str]:
        """What makes the soak a failure: its numbers are kept, but the run does not pass."""
        out = []
        last = self.rows[-1] if self.rows else None
        if last is None:
            return ["no row was taken"]
        if last.unexpected:
            out.append(f"{last.unexpected} jobs ended otherwise than their kind says")
        if last.stuck:
            out.append(f"{last.stuck} jobs did not end within {JOB_DEADLINE_S:g} s")
        if self.submit_errors:
            out.append(f"{len(self.submit_errors)} submits failed: {self.submit_errors[0]}")
        if self.sim_live != self.options.nodes or self.sim_sessions_ended:
            out.append(
                f"simulated nodes lost: {self.sim_live}/{self.options.nodes} live, "
                f"{self.sim_sessions_ended} sessions dropped"
            )
        if self.background_state != JobState.RUNNING.value:
            out.append(f"the background job is {self.background_state}, not RUNNING")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "options": asdict(self.options),
            "rows": [asdict(r) for r in self.rows],
            "outcomes": dict(self.outcomes),
            "skipped": self.skipped,
            "poll_errors": self.poll_errors,
            "submit_errors": self.submit_errors[:20],
            "sim_live": self.sim_live,
            "sim_sessions_ended": self.sim_sessions_ended,
            "background_state": self.background_state,
            "problems": self.problems(),
            "max_in_flight": MAX_IN_FLIGHT,
            "job_deadline_s": JOB_DEADLINE_S,
        }


_HEADER = (
    "  t (min)  RSS MB  state MB   (db + wal)  submits  p50 ms  p99 ms  max ms  CPU  load  "
    "listed  in flight  finished  unexpected  stuck"
)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def render_row(r: Row) -> str:
    return (
        f"  {r.t_s / 60:7.2f}  {r.rss_mb:6.1f}  {r.state_mb:8.2f}  ({r.db_mb:5.2f} + "
        f"{r.wal_mb:5.2f})  {r.submits:7d}  {_ms(r.submit_p50_ms):>6}  {_ms(r.submit_p99_ms):>6}"
        f"  {_ms(r.submit_max_ms):>6}  {r.coordinator_cpu:3.2f}  {r.load1:4.1f}  "
        f"{r.jobs_listed:6d}  {r.in_flight:9d}  {r.finished:8d}  "
        f"{r.unexpected:10d}  {r.stuck:5d}"
    )


def render_rows(rows: Sequence[Row]) -> str:
    return "\n".join([_HEADER, *(render_row(r) for r in rows)])


# ---- the job stream -----------------------------------------------------------------------------


@dataclass
class _Pending:
    job: Job
    kind: str
    submitted: float
    cancel_at: float | None = None
    cancelled: bool = False


def _short_job(kind: str, rng: random.Random, n: int) -> JobSpec:
    nodes = rng.choice((1, 1, 2))
    common: dict[str, Any] = {
        "name": f"soak-{kind}-{n}",
        "nproc_per_node": rng.choice((1, 2)),
        "min_nodes": nodes,
        "max_nodes": nodes,
        "last_call_timeout": 0.0,
        "stop_grace": 2.0,
        "join_timeout": JOB_DEADLINE_S,
        "exit_barrier_timeout": 30.0,
    }
    if kind == "ok":
        return JobSpec(entrypoint=["/bin/true"], **common)
    if kind == "fail":
        script = f"echo 'soak: job {n} fails on purpose' >&2; exit 3"
        return JobSpec(
            entrypoint=["/bin/sh", "-c", script], max_restarts=rng.choice((0, 0, 0, 1)), **common
        )
    return JobSpec(entrypoint=["/bin/sleep", "120"], **common)


def _dir_mb(path: Path) -> tuple[float, float, float]:
    """(whole directory, *.sqlite3, *-wal) in MB; files that vanish meanwhile count 0."""
    total = db = wal = 0
    for p in path.rglob("*") if path.exists() else ():
        with contextlib.suppress(OSError):
            if p.is_file():
                size = p.stat().st_size
                total += size
                if p.name.endswith(".sqlite3"):
                    db += size
                elif p.name.endswith("-wal"):
                    wal += size
    return total / 2**20, db / 2**20, wal / 2**20


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


class _Stream:
    """Submits the short jobs, follows them to their end and samples the coordinator.

    Three threads, so that a slow call of one kind does not delay the others: the submitter
    keeps the rate (its latencies are what a row reports), the follower polls the unfinished
    jobs, and the caller's thread takes a row every interval.
    """

    def __init__(
        self, opts: SoakOptions, client: Client, coord: psutil.Process, state_dir: Path
    ) -> None:
        self.opts = opts
        self.client = client
        self.coord = coord
        self.state_dir = state_dir
        self.rng = random.Random(opts.seed)
        self.lock = threading.Lock()
        self.pending: list[_Pending] = []
        self.latencies: list[float] = []
        self.report = SoakReport(opts)
        self.unexpected = 0
        self.stuck = 0
        self.submitted = 0
        self.errors: list[BaseException] = []
        self.submitting = threading.Event()
        self.following = threading.Event()
        self.t0 = time.monotonic()
        self._cpu_at = self._since_start()

    def _since_start(self) -> tuple[float, float]:
        """(monotonic time the coordinator started, 0 CPU s): the first row covers the setup."""
        age = max(0.0, time.time() - self.coord.create_time())
        return time.monotonic() - age, 0.0

    def _kind(self) -> str:
        x, acc = self.rng.random(), 0.0
        for kind, share in MIX:
            acc += share
            if x < acc:
                return kind
        return MIX[-1][0]

    def submit(self) -> None:
        with self.lock:
            if len(self.pending) >= MAX_IN_FLIGHT:
                self.report.skipped += 1
                return
        kind = self._kind()
        spec = _short_job(kind, self.rng, self.submitted)
        self.submitted += 1
        t = time.perf_counter()
        try:
            job = self.client.submit(spec)
        except GelasticError as exc:
            with self.lock:
                self.report.submit_errors.append(str(exc))
            log(f"  {SCENARIO}: submit failed: {exc}")
            return
        latency = time.perf_counter() - t
        now = time.monotonic()
        cancel_at = now + self.rng.uniform(0.0, 1.5) if kind == "cancel" else None
        with self.lock:
            self.latencies.append(latency)
            self.pending.append(_Pending(job, kind, now, cancel_at))

    def follow(self, *, draining: bool = False) -> None:
        """Ask every unfinished job for its state once; cancel what is due."""
        with self.lock:
            pending = list(self.pending)
        done: set[int] = set()
        ended: list[str] = []
        for p in pending:
            now = time.monotonic()
            try:
                state = p.job.status().state
            except GelasticError as exc:
                if exc.code == grpc.StatusCode.NOT_FOUND:
                    # Finished and already dropped by retention between two polls.
                    ended.append(f"{p.kind}->gone")
                    done.add(id(p))
                else:  # a coordinator too busy to answer in time: ask again next round
                    self.report.poll_errors += 1
                continue
            if state.is_terminal():
                ended.append(f"{p.kind}->{state.value}")
                if state != EXPECTED[p.kind] and not (p.kind != "cancel" and p.cancelled):
                    self.unexpected += 1
                    log(f"  {SCENARIO}: job {p.job.job_id} ({p.kind}) ended {state.value}")
                done.add(id(p))
                continue
            due = p.cancel_at is not None and (now >= p.cancel_at or draining)
            if due and not p.cancelled:
                self._cancel(p)
            elif now - p.submitted > JOB_DEADLINE_S and not p.cancelled:
                self.stuck += 1
                log(
                    f"  {SCENARIO}: job {p.job.job_id} ({p.kind}) still {state.value} after "
                    f"{JOB_DEADLINE_S:g} s; cancelling it"
                )
                self._cancel(p)
        with self.lock:
            self.report.outcomes.update(ended)
            self.pending = [p for p in self.pending if id(p) not in done]

    def _cancel(self, p: _Pending) -> None:
        p.cancelled = True
        with contextlib.suppress(GelasticError):  # it may have ended meanwhile
            p.job.cancel()

    def _submitter(self) -> None:
        try:
            next_at = time.monotonic()
            while self.submitting.is_set():
                self.submit()
                # Behind schedule (a slow call): catch up by at most a second, never in a burst.
                next_at = max(next_at + 1 / self.opts.rate, time.monotonic() - 1.0)
                time.sleep(max(0.0, next_at - time.monotonic()))
        except BaseException as exc:  # handed to the caller's thread, which raises it
            self.errors.append(exc)

    def _follower(self) -> None:
        try:
            while self.following.is_set():
                t = time.monotonic()
                self.follow(draining=not self.submitting.is_set())
                time.sleep(max(0.0, t + POLL_S - time.monotonic()))
        except BaseException as exc:
            self.errors.append(exc)

    def sample(self, now: float) -> Row:
        with self.lock:
            lat_ms = [v * 1000 for v in self.latencies]
            self.latencies = []
            in_flight = len(self.pending)
            finished = sum(self.report.outcomes.values())
        state, db, wal = _dir_mb(self.state_dir)
        try:
            listed = len(self.client.list_jobs(include_finished=True))
        except GelasticError as exc:
            log(f"  {SCENARIO}: ListJobs failed: {exc}")
            listed = -1
        cpu = cpu_seconds(self.coord)
        (t_prev, cpu_prev), self._cpu_at = self._cpu_at, (now, cpu)
        row = Row(
            t_s=round(now - self.t0, 1),
            rss_mb=round(self.coord.memory_info().rss / 2**20, 2),
            state_mb=round(state, 3),
            db_mb=round(db, 3),
            wal_mb=round(wal, 3),
            submits=len(lat_ms),
            submit_p50_ms=_round(_percentile(lat_ms, 50)),
            submit_p99_ms=_round(_percentile(lat_ms, 99)),
            submit_max_ms=_round(max(lat_ms) if lat_ms else None),
            coordinator_cpu=round((cpu - cpu_prev) / max(now - t_prev, 1e-6), 3),
            load1=round(os.getloadavg()[0], 2),
            jobs_listed=listed,
            in_flight=in_flight,
            finished=finished,
            unexpected=self.unexpected,
            stuck=self.stuck,
        )
        self.report.rows.append(row)
        log(render_row(row))
        return row

    def _check(self) -> None:
        if self.errors:
            raise RuntimeError(f"the soak's job stream failed: {self.errors[0]!r}") from (
                self.errors[0]
            )

    def run(self) -> SoakReport:
        opts = self.opts
        log(_HEADER)
        self.t0 = time.monotonic()
        end = self.t0 + opts.minutes * 60
        self.sample(self.t0)
        self.submitting.set()
        self.following.set()
        threads = [
            threading.Thread(target=self._submitter, name="soak-submit", daemon=True),
            threading.Thread(target=self._follower, name="soak-follow", daemon=True),
        ]
        for t in threads:
            t.start()
        try:
            next_row = self.t0 + opts.interval
            while (now := time.monotonic()) < end:
                self._check()
                if now >= next_row:
                    self.sample(now)
                    next_row += opts.interval
                time.sleep(max(0.0, min(next_row, end) - time.monotonic()))
            self.submitting.clear()
            threads[0].join(30)
            # Let what is still running end: the follower cancels the sleepers now and gives
            # the rest their deadline (stuck past it). Bounded: what is left then is stuck too.
            drain_until = time.monotonic() + JOB_DEADLINE_S + 15
            while time.monotonic() < drain_until:
                self._check()
                with self.lock:
                    if not self.pending:
                        break
                time.sleep(0.2)
        finally:
            self.submitting.clear()
            self.following.clear()
            for t in threads:
                t.join(30)
        self._check()
        with self.lock:
            self.stuck += len(self.pending)
        self.sample(time.monotonic())
        return self.report


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


# ---- the cluster ---------------------------------------------------------------------------------


def run_soak(opts: SoakOptions) -> SoakReport:
    """The whole soak: set up, stream jobs for `opts.minutes`, tear down; every wait bounded."""
    opts.validate()
    coordinator_args = [*COORDINATOR_DEFAULT_ARGS, *opts.coordinator_args]
    cluster = LocalCluster(
        nodes=0,
        slots=REAL_SLOTS,
        lease=LEASE_S,
        heartbeat_interval=HEARTBEAT_S,
        coordinator_args=coordinator_args,
    )
    fleet: SimFleet | None = None
    client: Client | None = None
    setup_timeout = 60.0 + opts.nodes / 20
    try:
        log(f"  {SCENARIO}: coordinator serve {' '.join(coordinator_args)}")
        cluster.start_coordinator()
        assert cluster.coordinator is not None
        coord = psutil.Process(cluster.coordinator.popen.pid)
        client = cluster.connect()
        # The background job takes every simulated node before the real agents exist, so the
        # short jobs can only land on the real agents (a simulated node never ends its workers).
        fleet = SimFleet(
            cluster.address,
            opts.nodes,
            processes=2,
            slots=1,
            health=True,
            token_file=cluster.token_file,
        )
        fleet.start()
        fleet.wait_welcomed(setup_timeout)
        background = client.submit(sim_job_spec(opts.nodes, 1, name="soak-background"))
        times = wait_round_started(fleet, client, background.job_id, setup_timeout)
        if times.all_started is None:
            raise TimeoutError(
                f"the background job started on {times.started}/{opts.nodes} simulated nodes "
                f"within {setup_timeout:g} s"
            )
        for i in range(REAL_AGENTS):
            cluster.start_agent(f"node-{i}", wait=False)
        names = {f"node-{i}" for i in range(REAL_AGENTS)}
        cluster.wait_nodes(lambda live: names <= live, f"{REAL_AGENTS} agents to register", 60)
        log(
            f"  {SCENARIO}: {opts.nodes} simulated nodes held by the background job, "
            f"{REAL_AGENTS} agents; {opts.rate:g} jobs/s for {opts.minutes:g} min, a row every "
            f"{opts.interval:g} s"
        )
        report = _Stream(opts, client, coord, cluster.workdir / "coordinator-state").run()

        stats = fleet.stats()
        report.sim_sessions_ended = stats.ended
        report.sim_live = sum(
            1 for n in client.list_nodes() if n.state == "live" and n.name.startswith("sim-")
        )
        report.background_state = background.status().state.value
        log(f"  {SCENARIO}: {report.summary()}")
        if stats.errors:
            log(f"  {SCENARIO}: simulated nodes saw: {stats.errors[:3]}")
        return report
    finally:
        if client is not None:
            client.close()
        killed = cluster.stop(timeout=20.0)
        if fleet is not None:
            fleet.stop()
        if killed:
            log(f"  {SCENARIO}: warning: had to kill {[str(k) for k in killed]}")
        with contextlib.suppress(TimeoutError):
            poll_until(lambda: not cluster.leftovers(), 15, what="the soak's processes to exit")
        shutil.rmtree(cluster.workdir, ignore_errors=True)


def quick_options() -> SoakOptions:
    return SoakOptions(minutes=QUICK_MINUTES, interval=QUICK_INTERVAL_S, nodes=QUICK_NODES)


def run(runs: int, quick: bool) -> list[Measurement]:
    """One soak at the default (or quick) size; `runs` does not repeat it (it is one long run)."""
    return run_soak(quick_options() if quick else SoakOptions()).measurements()
