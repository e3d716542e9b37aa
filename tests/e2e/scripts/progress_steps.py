"""Independent ranks that step and report progress (no collective): $SLOW_RANK sleeps
$EXTRA_S more per step; each runs for $RUN_S seconds, then exits 0."""

import os
import time

from client import progress

rank = int(os.environ["RANK"])
step_s = float(os.environ.get("STEP_S", "0.02"))
extra = (
    float(os.environ.get("EXTRA_S", "0.05"))
    if rank == int(os.environ.get("SLOW_RANK", "-1"))
    else 0.0
)
end = time.monotonic() + float(os.environ.get("RUN_S", "30"))
step = 0
while time.monotonic() < end:
    time.sleep(step_s + extra)
    progress(step, loss=1.0 / (step + 1))
    step += 1
