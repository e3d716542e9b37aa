"""A worker whose SIGTERM handler saves a checkpoint for 2 s ($CKPT_S), the usual preemption
pattern.

Stamps (epoch seconds) go to $OUT_DIR as `<what>.<rank>.<tag>`: start, term (SIGTERM
received), ckpt (the checkpoint finished). $CKPT_MODE says what the job does:
- "crash" (tag: the restart count): in attempt 0 rank 1 exits 3 once rank 0 runs, the other
  ranks run until stopped; attempt 1 ends at once.
- "world" (tag: the world size): in a world of more than one rank every rank runs until
  stopped; alone (the job re-formed on one node) it ends.
The worker's pid goes to $OUT_DIR as `pid.<rank>.<tag>`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import types

out = os.environ["OUT_DIR"]
rank = os.environ["RANK"]
mode = os.environ.get("CKPT_MODE", "crash")
tag = os.environ["TORCHELASTIC_RESTART_COUNT" if mode == "crash" else "WORLD_SIZE"]
checkpoint_s = float(os.environ.get("CKPT_S", "2"))


def stamp(what: str) -> None:
    with open(os.path.join(out, f"{what}.{rank}.{tag}"), "w") as f:
        f.write(repr(time.time()))


def on_term(signum: int, frame: types.FrameType | None) -> None:
    stamp("term")
    time.sleep(checkpoint_s)  # the checkpoint being written
    stamp("ckpt")
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
with open(os.path.join(out, f"pid.{rank}.{tag}"), "w") as f:
    f.write(str(os.getpid()))
stamp("start")
deadline = time.monotonic() + 60
if mode == "world":
    while tag != "1" and time.monotonic() < deadline:
        time.sleep(0.05)
elif tag == "0":
    if rank == "1":
        while not os.path.exists(os.path.join(out, "start.0.0")) and time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit(3)
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(4)
