"""Writes what a worker sees at its start to $OUT_DIR/<RANK>.json (standby tests).

Run as a script, as ``-m tests.workloads.standby_probe`` or through `probe` (a function).
"""

import json
import os
import sys

PRELOADED = "email.mime.text" in sys.modules  # the standby tests preload this module


def probe(tag: str = "function") -> int:
    rank = os.environ["RANK"]
    seen = {
        "tag": tag,
        "name": __name__,
        "main_file": getattr(sys.modules["__main__"], "__file__", None),
        "argv": sys.argv,
        "path0": sys.path[0],
        "preloaded": PRELOADED,
        "pid": os.getpid(),
        "env": {
            k: os.environ.get(k)
            for k in (
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "MASTER_PORT",
                "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_ERROR_FILE",
                "JOB_VAR",
                "GELASTIC_WORKER_MARK",
            )
        },
        "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
    }
    with open(os.path.join(os.environ["OUT_DIR"], f"{rank}.json"), "w") as f:
        json.dump(seen, f)
    print(f"probe rank {rank} out")
    print(f"probe rank {rank} err", file=sys.stderr)
    if os.environ.get("PROBE_FAIL") == rank:
        raise RuntimeError(f"probe rank {rank} fails")
    return int(rank) * 10


if __name__ == "__main__":
    probe("main")
