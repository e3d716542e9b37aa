"""stacks: how long `gelastic stack` takes to show where every rank of a job is.

Two agents (LocalCluster lease 3 s, heartbeat 0.5 s), one job of 2 workers per node whose
workers wait in a python loop on time.sleep. Once the 4 are running, each run times
`client.capture_stacks(job_id)` from the call to the grouped answer (the coordinator asks both
agents, each runs py-spy against its own two workers in parallel, the capture is written with
the job), then the same with `native=True` (py-spy --native: C frames too).

torchrun has no such command; what its users do is run `py-spy dump --pid P` on each host, for
each rank: `py-spy dump of every rank, one by one` times that by hand, here on the same 4 pids,
one after the other (one host: no ssh counted).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from bench._common import GELASTIC, PY, TORCH, Measurement, gelastic_cluster, log
from client import JobSpec
from gelastic.local import poll_until

SCENARIO = "stacks"
NODES, NPROC = 2, 2
WAIT_LOOP = (
    "import time\nend = time.monotonic() + 600\n"
    "while time.monotonic() < end:\n    time.sleep(0.05)\n"
)


def run(runs: int, quick: bool) -> list[Measurement]:
    capture = Measurement(SCENARIO, "capture of 2x2 ranks -> grouped answer", GELASTIC)
    native = Measurement(SCENARIO, "capture of 2x2 ranks, --native", GELASTIC)
    by_hand = Measurement(SCENARIO, "py-spy dump of every rank, one by one", TORCH)
    beside = Path(PY).with_name("py-spy")  # what the agent runs: the one of its python
    py_spy = str(beside) if beside.exists() else shutil.which("py-spy")
    with gelastic_cluster(nodes=NODES) as cluster:
        client = cluster.client
        job = client.submit(
            JobSpec(
                entrypoint=[PY, "-c", WAIT_LOOP],
                nproc_per_node=NPROC,
                min_nodes=NODES,
                max_nodes=NODES,
                last_call_timeout=0,
            )
        )
        poll_until(
            lambda: len([w for w in job.status().workers if w.pid]) == NODES * NPROC,
            60,
            what="every worker running",
        )
        pids = [w.pid for w in job.status().workers]
        for i in range(runs):
            began = time.monotonic()
            c = client.capture_stacks(job.job_id)
            capture.add(time.monotonic() - began)
            began = time.monotonic()
            client.capture_stacks(job.job_id, native=True)
            native.add(time.monotonic() - began)
            if py_spy is not None:
                began = time.monotonic()
                for pid in pids:
                    subprocess.run(
                        [py_spy, "dump", "--pid", str(pid)], capture_output=True, timeout=30
                    )
                by_hand.add(time.monotonic() - began)
            log(
                f"  {SCENARIO} run {i + 1}/{runs}: capture {capture.values[-1]:.3f} s "
                f"({c.ranks} ranks in {len(c.groups)} groups), native {native.values[-1]:.3f} s"
            )
        job.cancel()
        poll_until(lambda: job.status().state.is_terminal(), 60, what="the job to end")
    return [capture, native, by_hand]
