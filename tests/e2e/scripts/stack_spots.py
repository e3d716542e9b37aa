"""Each rank waits in a function with a name a stack capture must show: $ODD_RANK waits in
another one. Each touches $OUT_DIR/ready-RANK once it is there; every wait is bounded."""

import os
import time
from pathlib import Path

LIMIT_S = 120.0


def gelastic_stack_probe_wait(ready: Path) -> None:
    ready.touch()
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)


def gelastic_stack_odd_one_out(ready: Path) -> None:
    ready.touch()
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)


rank = os.environ["RANK"]
ready = Path(os.environ["OUT_DIR"]) / f"ready-{rank}"
if os.environ.get("ODD_RANK") == rank:
    gelastic_stack_odd_one_out(ready)
else:
    gelastic_stack_probe_wait(ready)
