"""What the GPU test workers share: write what a rank saw, then keep the GPU busy until told."""

import json
import os
import time


def report(seen: dict, rank: int) -> None:
    """Write `seen` to $OUT_DIR/rank<rank>.json, whole (a reader never sees half of it)."""
    path = os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(seen, f)
    os.replace(path + ".tmp", path)


def hold(step) -> None:
    """Call `step` every 0.2 s until $HOLD_FILE exists (at most 300 s; no $HOLD_FILE: return)."""
    until = os.environ.get("HOLD_FILE")
    deadline = time.monotonic() + 300
    while until and not os.path.exists(until) and time.monotonic() < deadline:
        step()
        time.sleep(0.2)
