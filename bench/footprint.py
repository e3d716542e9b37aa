"""footprint: what a real node agent costs its host, idle and supervising 8 workers.

A LocalCluster of one `coordinator serve` and one `nodeagent` (8 slots) with the
coordinator's default timing (heartbeat 1 s, lease 5 s). After a settling pause:

- idle, for a window: the agent's RSS (the largest of samples every 0.5 s) and CPU (% of
  one core over the window), and the coordinator's RSS and CPU.
- then a 1 x 8 job of `python -c "import time; time.sleep(30)"`; once all 8 workers run
  (+1 s), the same for the agent over a window, while it supervises them (it samples their
  health for every heartbeat). The job is canceled afterwards.

CPU is the time the process's threads spent on a CPU (`/proc/PID/task/*/schedstat`, in
nanoseconds; psutil's clock-tick counters where that is missing) divided by the window's wall
time. RSS counts shared pages (the interpreter, libraries); the note adds USS (memory only this
process holds). One sample per metric: these are steady states, not events.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil

from bench._common import GELASTIC, PY, Measurement, log, warn_leftovers
from client import JobSpec, JobState
from gelastic.local import LocalCluster, poll_until

SCENARIO = "footprint"
SLOTS = 8
SETTLE_S, QUICK_SETTLE_S = 5.0, 1.0
WINDOW_S, QUICK_WINDOW_S = 20.0, 4.0
SAMPLE_S = 0.5
MB = 1024 * 1024


def cpu_ns(proc: psutil.Process) -> float:
    """CPU seconds the process's live threads have used, at nanosecond resolution."""
    total = 0
    try:
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    except OSError:
        total = 0
    if total:
        return total / 1e9
    t = proc.cpu_times()
    return float(t.user + t.system)


def _window(procs: dict[str, psutil.Process], seconds: float) -> dict[str, tuple[float, int, int]]:
    """name -> (CPU % of one core, max RSS, max USS) over `seconds` of wall time."""
    c0 = {k: cpu_ns(p) for k, p in procs.items()}
    rss = dict.fromkeys(procs, 0)
    uss = dict.fromkeys(procs, 0)
    t0 = time.monotonic()
    while True:
        for k, p in procs.items():
            m = p.memory_full_info()
            rss[k] = max(rss[k], m.rss)
            uss[k] = max(uss[k], m.uss)
        left = t0 + seconds - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(SAMPLE_S, left))
    wall = time.monotonic() - t0
    return {k: (100 * (cpu_ns(p) - c0[k]) / wall, rss[k], uss[k]) for k, p in procs.items()}


def run(runs: int, quick: bool) -> list[Measurement]:
    settle = QUICK_SETTLE_S if quick else SETTLE_S
    window = QUICK_WINDOW_S if quick else WINDOW_S

    def m(metric: str) -> Measurement:
        return Measurement(SCENARIO, metric, GELASTIC)

    idle_rss, idle_cpu = m("idle agent RSS (MB)"), m("idle agent CPU (%)")
    busy_rss, busy_cpu = m("agent RSS, 8 workers (MB)"), m("agent CPU, 8 workers (%)")
    coord_rss, coord_cpu = m("idle coordinator RSS (MB)"), m("idle coordinator CPU (%)")

    cluster = LocalCluster(nodes=1, slots=SLOTS, lease=5.0, heartbeat_interval=1.0)
    try:
        cluster.start()
        assert cluster.coordinator is not None
        agent = psutil.Process(cluster.agents["node-0"].popen.pid)
        coord = psutil.Process(cluster.coordinator.popen.pid)
        time.sleep(settle)
        idle = _window({"agent": agent, "coordinator": coord}, window)
        cpu, rss, uss = idle["agent"]
        idle_cpu.add(cpu)
        idle_rss.add(rss / MB)
        idle_rss.note = f"USS {uss / MB:.1f} MB"
        cpu, rss, uss = idle["coordinator"]
        coord_cpu.add(cpu)
        coord_rss.add(rss / MB)
        coord_rss.note = f"USS {uss / MB:.1f} MB"
        log(
            f"  {SCENARIO} idle ({window:g} s): agent {idle['agent'][0]:.3f}% CPU, "
            f"{idle['agent'][1] / MB:.1f} MB RSS; coordinator {idle['coordinator'][0]:.3f}% CPU, "
            f"{idle['coordinator'][1] / MB:.1f} MB RSS"
        )

        job = cluster.client.submit(
            JobSpec(
                entrypoint=[PY, "-c", "import time; time.sleep(30)"],
                nproc_per_node=SLOTS,
                name="bench-footprint",
            )
        )

        def running() -> bool:
            s = job.status()
            return s.state == JobState.RUNNING and sum(1 for w in s.workers if w.pid) == SLOTS

        poll_until(running, 30, what=f"{SLOTS} workers to run")
        time.sleep(1.0)
        busy = _window({"agent": agent}, window)
        cpu, rss, uss = busy["agent"]
        busy_cpu.add(cpu)
        busy_rss.add(rss / MB)
        busy_rss.note = f"USS {uss / MB:.1f} MB"
        alive = sum(1 for c in agent.children(recursive=True) if c.is_running())
        busy_cpu.note = f"{alive} worker processes alive at the end of the window"
        log(
            f"  {SCENARIO} {SLOTS} workers ({window:g} s): agent {cpu:.3f}% CPU, "
            f"{rss / MB:.1f} MB RSS ({alive} workers alive)"
        )
        job.cancel()
        poll_until(lambda: job.poll() is not None, 60, what="the job to be canceled")
    finally:
        warn_leftovers(cluster.stop())
    if runs > 1:
        idle_cpu.note = "one window per metric, whatever --runs says"
    return [idle_rss, idle_cpu, busy_rss, busy_cpu, coord_rss, coord_cpu]
