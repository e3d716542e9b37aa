"""submit_throughput: jobs the coordinator accepts per second, every one durably written.

A fresh `coordinator serve` per run (`CoordinatorProcess`: its `--state-dir` a temporary
directory on this host's disk; SQLite in WAL mode, `synchronous=FULL`, and Submit answers only
once its job is on disk) and no agents, so every job stays QUEUED. M jobs of a trivial spec
(`/bin/true`, 1 node x 1 worker) are submitted with the sync client (`Client.submit`) from
1 thread, then from 8 threads at once (a `Client` each, M/8 jobs each). Every client first
submits one untimed job (connection set-up); then the clock runs from releasing the threads to
the last answer. Afterwards ListJobs must show all of them QUEUED; the coordinator is stopped
with its queue.

- `T client thread(s): jobs/s`: M / that time. M = 500 (`--quick`: 50).
- `etcd, K member(s): T client thread(s): jobs/s`: the same with `--store etcd://...` on a
  fresh etcd cluster of K members on this host (each member its own data directory on the
  same disk), K = 1 and 3 (`--quick`: 3). Skipped, with a line on stderr, without etcd.

The note gives the median latency of one Submit (its p99 in brackets) and the coordinator's
CPU time over the submitting (in cores), which tells whether it waited on the disk or computed.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

from bench._common import GELASTIC, Measurement, log
from bench._etcd import EtcdCluster, etcd_binary
from bench._simnodes import CoordinatorProcess, cpu_seconds
from client import Client, JobSpec, JobState

SCENARIO = "submit_throughput"
JOBS = 500
QUICK_JOBS = 50
THREADS = (1, 8)
STORES = (0, 1, 3)
"""0: SQLite; K > 0: etcd with K members."""
QUICK_STORES = (0, 3)
TIMEOUT = 300.0
SPEC = JobSpec(entrypoint=["/bin/true"], nproc_per_node=1, min_nodes=1, max_nodes=1, name="tput")


@dataclass
class _Run:
    rate: float
    latencies: list[float]
    cpu_cores: float


def one_run(jobs: int, threads: int, members: int = 0, extra: tuple[str, ...] = ()) -> _Run:
    """One fresh coordinator (`extra`: more of its flags) and `jobs` submits from `threads`."""
    etcd = EtcdCluster(members).start() if members else None
    store = ("--store", etcd.url("gelastic")) if etcd is not None else ()
    coord = CoordinatorProcess(
        lease=5.0, heartbeat_interval=1.0, log_level="WARNING", extra_args=(*store, *extra)
    )
    clients: list[Client] = []
    try:
        coord.start()
        clients = [Client(coord.address, timeout=60.0) for _ in range(threads)]
        for c in clients:
            c.submit(SPEC)  # untimed: connects the channel
        share = [jobs // threads + (1 if i < jobs % threads else 0) for i in range(threads)]
        latencies: list[list[float]] = [[] for _ in range(threads)]
        errors: list[BaseException] = []
        go = threading.Barrier(threads + 1)

        def submit_all(i: int) -> None:
            try:
                go.wait(timeout=30)
                for _ in range(share[i]):
                    t = time.perf_counter()
                    clients[i].submit(SPEC)
                    latencies[i].append(time.perf_counter() - t)
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        workers = [
            threading.Thread(target=submit_all, args=(i,), daemon=True) for i in range(threads)
        ]
        for w in workers:
            w.start()
        proc = coord.process()
        cpu0 = cpu_seconds(proc)
        go.wait(timeout=30)
        t0 = time.perf_counter()
        deadline = time.monotonic() + TIMEOUT
        for w in workers:
            w.join(timeout=max(0.1, deadline - time.monotonic()))
        elapsed = time.perf_counter() - t0
        cpu = cpu_seconds(proc) - cpu0
        if any(w.is_alive() for w in workers):
            raise TimeoutError(f"{jobs} submits from {threads} threads took over {TIMEOUT:g} s")
        if errors:
            raise RuntimeError(f"a submit failed: {errors[0]!r}")
        listed = clients[0].list_jobs()
        queued = sum(1 for j in listed if j.state == JobState.QUEUED)
        if queued != jobs + threads:
            raise RuntimeError(f"{queued} jobs QUEUED, expected {jobs + threads}")
        return _Run(jobs / elapsed, [x for lat in latencies for x in lat], cpu / elapsed)
    finally:
        for c in clients:
            c.close()
        coord.stop(grace=10.0)
        if etcd is not None:
            etcd.stop()


def _p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def run(runs: int, quick: bool) -> list[Measurement]:
    jobs = QUICK_JOBS if quick else JOBS
    out: list[Measurement] = []
    stores = QUICK_STORES if quick else STORES
    if etcd_binary() is None:
        log(f"  {SCENARIO}: etcd is not installed; only SQLite is measured")
        stores = (0,)
    for members, threads in ((k, t) for k in stores for t in THREADS):
        where = f"etcd, {members} member{'s' if members > 1 else ''}: " if members else ""
        m = Measurement(
            SCENARIO,
            f"{where}{threads} client thread{'s' if threads > 1 else ''}: jobs/s ({jobs} jobs)",
            GELASTIC,
        )
        lat_ms: list[float] = []
        p99_ms: list[float] = []
        cores: list[float] = []
        for i in range(runs):
            r = one_run(jobs, threads, members)
            m.add(r.rate)
            lat_ms.append(statistics.median(r.latencies) * 1000)
            p99_ms.append(_p99(r.latencies) * 1000)
            cores.append(r.cpu_cores)
            log(
                f"  {SCENARIO} {where}{threads} thread(s) run {i + 1}/{runs}: {r.rate:.0f} jobs/s, "
                f"submit latency median {lat_ms[-1]:.1f} ms (p99 {p99_ms[-1]:.1f} ms), "
                f"coordinator CPU {r.cpu_cores:.2f} cores"
            )
        m.note = (
            f"unit jobs/s, not s; submit latency median {statistics.median(lat_ms):.1f} ms "
            f"(p99 {statistics.median(p99_ms):.1f} ms); coordinator CPU "
            f"{statistics.median(cores):.2f} cores while submitting"
        )
        out.append(m)
    return out
