"""Sleeps briefly, then the rank named by $FAIL_RANK exits with $FAIL_CODE; others sleep on."""

import os
import sys
import time

rank = os.environ["RANK"]
if rank == os.environ.get("FAIL_RANK"):
    time.sleep(float(os.environ.get("FAIL_AFTER", "0.5")))
    print(f"rank {rank} failing on purpose", file=sys.stderr, flush=True)
    sys.exit(int(os.environ.get("FAIL_CODE", "3")))
time.sleep(float(os.environ.get("SLEEP", "60")))
