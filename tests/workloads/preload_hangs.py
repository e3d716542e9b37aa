"""A preload module whose import does not end (for at most 60 s, or until $HANG_UNTIL exists)."""

import os
import time

_deadline = time.monotonic() + 60
while not os.path.exists(os.environ.get("HANG_UNTIL", "/nonexistent")):
    if time.monotonic() > _deadline:
        break
    time.sleep(0.05)
