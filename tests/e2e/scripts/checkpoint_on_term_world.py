"""A worker whose SIGTERM handler saves a checkpoint for 2 s, in a job that re-forms.

Stamps (epoch seconds) go to $OUT_DIR as `<what>.<rank>.<world>`: start, term, ckpt. In a world
of more than one rank it runs until stopped; alone (the job re-formed on one node) it ends.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import types

out = os.environ["OUT_DIR"]
rank = os.environ["RANK"]
world = os.environ["WORLD_SIZE"]


def stamp(what: str) -> None:
    with open(os.path.join(out, f"{what}.{rank}.{world}"), "w") as f:
        f.write(repr(time.time()))


def on_term(signum: int, frame: types.FrameType | None) -> None:
    stamp("term")
    time.sleep(2.0)  # the checkpoint being written
    stamp("ckpt")
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
stamp("start")
deadline = time.monotonic() + 60
while world != "1" and time.monotonic() < deadline:
    time.sleep(0.05)
