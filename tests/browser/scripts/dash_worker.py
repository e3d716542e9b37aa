"""A worker for the dashboard tests: prints a line, waits on a gate, maybe raises.

Every rank prints "rank R attempt A says hello <b id=bold>in markup</b>" to stdout at once, then waits for the file
$GATE_DIR/go. Rank $CRASH_RANK raises on attempt 0 with a message full of markup (the page
must show it as text); every other rank, and every later attempt, exits 0. A gate that stays
shut for 120 s makes the worker exit 3, so a broken test never leaves one waiting forever.
"""

import os
import sys
import time

rank = os.environ["RANK"]
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"rank {rank} attempt {attempt} says hello <b id=bold>in markup</b>", flush=True)
gate = os.path.join(os.environ["GATE_DIR"], f"go{attempt}")
deadline = time.monotonic() + 120
while not os.path.exists(gate):
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.02)
if rank == os.environ.get("CRASH_RANK") and attempt == 0:
    raise RuntimeError(os.environ["CRASH_MESSAGE"])
print(f"rank {rank} attempt {attempt} done", flush=True)
