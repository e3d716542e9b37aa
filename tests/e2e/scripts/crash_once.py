"""Records what it saw; rank $CRASH_RANK exits 1 on every attempt below $CRASH_UNTIL.

Without $GATE_DIR the crash comes $CRASH_AFTER s after the start and the others sleep $SLEEP s.
With $GATE_DIR the test decides when things happen instead of a sleep: every worker appends
one JSON line per event ("start", "crash", "finish", with its rank, attempt, round, node, pid
and time) to $GATE_DIR/events.jsonl; the crashing rank waits for $GATE_DIR/crash to exist, the
others for $GATE_DIR/finish; and each prints one line to stdout naming its rank, attempt, round
and the agent that started it ($GELASTIC_LOCAL_AGENT), to check logs against. A gate that stays shut for $GATE_TIMEOUT s (default 120) makes the
worker exit 3, so a broken test never leaves a worker waiting forever.
"""

import json
import os
import sys
import time

rank = os.environ["RANK"]
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
gate_dir = os.environ.get("GATE_DIR")
out = os.path.join(os.environ["OUT_DIR"], f"attempt{attempt}_rank{rank}.json")
with open(out, "w") as f:
    json.dump(
        {
            k: os.environ.get(k)
            for k in (
                "RANK",
                "TORCHELASTIC_RESTART_COUNT",
                "GROUP_RANK",
                "WORLD_SIZE",
                "MASTER_PORT",
            )
        }
        | {"pid": os.getpid()},
        f,
    )


def record(event: str) -> None:
    """Append one event line; a single O_APPEND write, so lines of concurrent workers never mix."""
    assert gate_dir is not None
    line = {
        "event": event,
        "rank": int(rank),
        "attempt": attempt,
        "round": int(os.environ.get("GELASTIC_ROUND", "0")),
        "node": os.environ.get("GELASTIC_LOCAL_AGENT", os.environ.get("GELASTIC_NODE", "")),
        "pid": os.getpid(),
        "time": time.time(),
    }
    fd = os.open(os.path.join(gate_dir, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


def wait_for(gate: str) -> None:
    assert gate_dir is not None
    path = os.path.join(gate_dir, gate)
    deadline = time.monotonic() + float(os.environ.get("GATE_TIMEOUT", "120"))
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            print(f"rank {rank}: gate {gate} stayed shut", file=sys.stderr, flush=True)
            sys.exit(3)
        time.sleep(0.02)


crashes = rank == os.environ.get("CRASH_RANK") and attempt < int(os.environ.get("CRASH_UNTIL", "1"))
if gate_dir is not None:
    record("start")
    print(
        f"rank {rank} attempt {attempt} round {os.environ.get('GELASTIC_ROUND')} "
        f"agent {os.environ.get('GELASTIC_LOCAL_AGENT')} node {os.environ.get('GELASTIC_NODE')}",
        flush=True,
    )
    wait_for("crash" if crashes else "finish")
else:
    time.sleep(
        float(os.environ.get("CRASH_AFTER", "0.3") if crashes else os.environ.get("SLEEP", "1"))
    )
if crashes:
    if gate_dir is not None:
        record("crash")
    print(f"rank {rank} crashing on attempt {attempt}", file=sys.stderr, flush=True)
    sys.exit(1)
if gate_dir is not None:
    record("finish")
