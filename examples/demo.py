"""`make demo`: a coordinator and two node agents on this host run a real 2 x 2 DDP job.

Everything it starts is stopped before it exits; it says so, and fails if anything is left.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from client import JobSpec, submit
from client._local import LocalCluster

HERE = Path(__file__).resolve().parent


def main() -> int:
    t0 = time.monotonic()
    print("starting a local cluster: 1 coordinator + 2 node agents on 127.0.0.1 ...", flush=True)
    with LocalCluster(nodes=2, slots=2) as cluster:
        for node in cluster.client.list_nodes():
            print(f"  node joined: {node.name} ({node.addr}, {node.slots} slots)", flush=True)
        spec = JobSpec(
            entrypoint=[sys.executable, str(HERE / "train_ddp.py")],
            args=["--steps", "30"],
            nproc_per_node=2,
            min_nodes=2,
            max_nodes=2,
            name="demo-ddp",
            tee="3",
        )
        job = submit(spec, coordinator=cluster.address, token_file=cluster.token_file)
        print(f"submitted {job.job_id} to {cluster.address}", flush=True)
        result = job.wait(timeout=300, progress=True, out=sys.stdout)
        for event in job.events():
            print(f"  event {event.kind:16s} {event.reason}")
        print()
        print("stdout of rank 0:")
        for chunk in job.logs(rank=0, stream="stdout"):
            sys.stdout.write(
                "  | " + chunk.decode(errors="replace").replace("\n", "\n  | ").rstrip("| ")
            )
        print()
        if result.is_failed():
            print(result.format_failures())
        else:
            print(
                f"RunResult: state={result.state.value} ranks={sorted(result.return_values) or 'n/a'}"
                f" failures={len(result.failures)}"
            )
    # What the stop had to SIGKILL outlived a graceful stop: that is what was left behind.
    left = [str(k) for k in cluster.killed] + [str(p.pid) for p in cluster.leftovers()]
    print(f"cluster stopped; processes left behind: {len(left)}  ({time.monotonic() - t0:.1f} s)")
    for what in left:
        print(f"  left behind: {what}")
    return 1 if result.is_failed() or left else 0


if __name__ == "__main__":
    sys.exit(main())
