"""The benchmark worker: one script for gelastic and torchrun alike (stdlib only, no torch).

It reads torchrun's environment (`RANK`, `WORLD_SIZE`, `TORCHELASTIC_RESTART_COUNT`) and
writes timestamps into `$BENCH_DIR`, each file written to a temporary name and renamed:

- `start-<pid>.json` at its first line: `{"t": time.time(), "rank", "restart", "pid"}`.
- `event` (the crash time): written by the rank named by `$BENCH_CRASH_RANK` right before it
  exits 1, or by the benchmark right before it kills an agent.

What it does (`$BENCH_MODE`):

- `exit`: exit 0 at once.
- `crash`: if `event` already exists the failure has happened and this is a later attempt: exit
  0 at once. Otherwise rank `$BENCH_CRASH_RANK` waits until all `WORLD_SIZE` workers have written
  their start file (plus `$BENCH_SETTLE` seconds, so the crash hits a running job), writes
  `event` and exits 1; the other ranks sleep as if training, until stopped.
- `hold`: like `crash` without a crashing rank: the workers of the first attempt sleep until
  stopped; workers started after `event` exists exit 0 at once.

A sleeping worker gives up after `$BENCH_HOLD_MAX` seconds (exit 2) so nothing can hang forever.
"""

from __future__ import annotations

import time

T0 = time.time()

import json  # noqa: E402 - the timestamp above is the first thing this script does
import os  # noqa: E402
import sys  # noqa: E402


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _count_starts(out: str) -> int:
    return sum(1 for n in os.listdir(out) if n.startswith("start-") and n.endswith(".json"))


def main() -> int:
    out = os.environ["BENCH_DIR"]
    rank = int(os.environ.get("RANK", "-1"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    event = os.path.join(out, "event")
    later = os.path.exists(event)
    stamp = {"t": T0, "rank": rank, "restart": restart, "pid": os.getpid(), "later": later}
    _write(os.path.join(out, f"start-{os.getpid()}.json"), json.dumps(stamp))
    mode = os.environ.get("BENCH_MODE", "exit")
    if mode == "exit" or later:
        return 0
    hold_max = float(os.environ.get("BENCH_HOLD_MAX", "120"))
    deadline = time.monotonic() + hold_max
    if mode == "crash" and rank == int(os.environ.get("BENCH_CRASH_RANK", "1")):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        while _count_starts(out) < world:
            if time.monotonic() > deadline:
                return 2
            time.sleep(0.01)
        time.sleep(float(os.environ.get("BENCH_SETTLE", "0.5")))
        print(f"rank {rank} failing on purpose", file=sys.stderr, flush=True)
        _write(event, json.dumps({"t": time.time(), "rank": rank}))
        return 1
    while time.monotonic() < deadline:
        time.sleep(0.2)
    return 2


if __name__ == "__main__":
    sys.exit(main())
