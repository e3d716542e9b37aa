"""Fails on cue, first on one node and then, a little later, with a collective's error elsewhere.

Every worker appends "ready" to $GATE_DIR/events.jsonl and waits for $GATE_DIR/go. The worker
on node $FIRST_NODE (the agent that started it, $GELASTIC_LOCAL_AGENT) then raises at once: the
true first failure. Every other worker raises $LATE_S seconds later what a gloo collective
raises when its peer is gone. Those ignore SIGTERM meanwhile, as a rank blocked in a collective
does not stop at once either: the stop that the first failure brings does not pre-empt theirs.
Each appends "raise" (with its node and time.time()) just before it raises. A gate that stays
shut for 120 s makes the worker exit 3.
"""

import json
import os
import signal
import sys
import time

rank = int(os.environ["RANK"])
node = os.environ.get("GELASTIC_LOCAL_AGENT", "")
gate_dir = os.environ["GATE_DIR"]
first = node == os.environ["FIRST_NODE"]


def record(event: str) -> None:
    """Append one event line; a single O_APPEND write, so lines of concurrent workers never mix."""
    line = {"event": event, "rank": rank, "node": node, "pid": os.getpid(), "time": time.time()}
    fd = os.open(os.path.join(gate_dir, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


if not first:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
record("ready")
go = os.path.join(gate_dir, "go")
deadline = time.monotonic() + 120
while not os.path.exists(go):
    if time.monotonic() > deadline:
        print(f"rank {rank}: gate go stayed shut", file=sys.stderr, flush=True)
        sys.exit(3)
    time.sleep(0.002)
if first:
    record("raise")
    raise ValueError(f"the true first failure, rank {rank} on {node}")
time.sleep(float(os.environ.get("LATE_S", "0.15")))
record("raise")
raise RuntimeError(
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
    "[127.0.0.1]:29500"
)
