"""Appends one line per start to $OUT_DIR/starts.log; rank $CRASH_RANK exits 1 on attempt 0."""

import os
import sys
import time

rank = os.environ["RANK"]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
fd = os.open(
    os.path.join(os.environ["OUT_DIR"], "starts.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT
)
os.write(fd, f"{attempt} {rank} {os.getpid()}\n".encode())
os.close(fd)
if rank == os.environ.get("CRASH_RANK") and attempt == "0":
    print(f"rank {rank} crashing on attempt 0", file=sys.stderr, flush=True)
    sys.exit(1)
time.sleep(float(os.environ.get("SLEEP", "0")))
