"""Rank $KILL_RANK writes a few stderr lines then SIGKILLs itself; the others sleep."""

import os
import signal
import sys
import time

rank = os.environ["RANK"]
print(f"hello stdout from rank {rank}", flush=True)
print(f"hello stderr from rank {rank}", file=sys.stderr, flush=True)
if rank == os.environ.get("KILL_RANK"):
    for i in range(3):
        print(f"last words {i} of rank {rank}", file=sys.stderr, flush=True)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(float(os.environ.get("SLEEP", "0")))
