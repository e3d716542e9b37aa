"""A preload module after which every fork of its process hangs before it is made.

It registers an `os.register_at_fork(before=...)` hook, as any module may: the hook touches
$HANG_MARK, then waits until $HANG_UNTIL exists (at most 60 s). In a zygote, a fork request then
goes unanswered for as long.
"""

import os
import time


def _before_fork() -> None:
    mark = os.environ.get("HANG_MARK")
    if mark:
        with open(mark, "a"):
            pass
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ.get("HANG_UNTIL", "/nonexistent")):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)


os.register_at_fork(before=_before_fork)
