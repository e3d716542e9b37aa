"""Records what it saw; rank $CRASH_RANK exits 1 on every attempt below $CRASH_UNTIL."""

import json
import os
import sys
import time

rank = os.environ["RANK"]
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = os.path.join(os.environ["OUT_DIR"], f"attempt{attempt}_rank{rank}.json")
with open(out, "w") as f:
    json.dump(
        {
            k: os.environ.get(k)
            for k in (
                "RANK",
                "TORCHELASTIC_RESTART_COUNT",
                "GROUP_RANK",
                "WORLD_SIZE",
                "MASTER_PORT",
            )
        }
        | {"pid": os.getpid()},
        f,
    )
if rank == os.environ.get("CRASH_RANK") and attempt < int(os.environ.get("CRASH_UNTIL", "1")):
    time.sleep(float(os.environ.get("CRASH_AFTER", "0.3")))
    print(f"rank {rank} crashing on attempt {attempt}", file=sys.stderr, flush=True)
    sys.exit(1)
time.sleep(float(os.environ.get("SLEEP", "1")))
