"""The multi-node benchmark worker: init_process_group(gloo), then all_reduce in a loop, as a
training script does, for gelastic and torchrun alike.

It reads torchrun's environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`/`MASTER_PORT`,
`TORCHELASTIC_RESTART_COUNT`) and writes timestamps into `$BENCH_DIR`, each to a temporary
name and renamed, all `{"t", "rank", "restart", "pid", "later", "world"}`:

- `start-<pid>.json`: its first statement (`time.time()`).
- `init-<pid>.json`: `init_process_group("gloo")` returned (gloo's full mesh is connected).
- `step-<pid>.json`: its first all_reduce of a 1-element tensor is done and checked (the sum of
  every rank's `rank + 1`): this rank trains.
- `event`: the crash time, written by rank `$BENCH_CRASH_RANK` right before it exits (the
  benchmark writes it itself right before it kills a launcher).

`later` is whether `event` already existed when the script began: a worker of a later attempt.

Every rank then goes on with an all_reduce every `$BENCH_STEP_S` seconds (0.1). A worker of a
later attempt, and any worker in mode `ready`, stops after `$BENCH_STEPS` all_reduces (5) and
exits 0. In the first attempt, in mode `crash`, rank `$BENCH_CRASH_RANK` waits (all_reducing
with the others) until all `WORLD_SIZE` ranks have their `step` stamp, plus `$BENCH_SETTLE`
seconds (0.5), writes `event` and exits 1 (`os._exit`: a hard crash); in mode `hold` every
rank trains until something ends it. A peer that is gone makes the next all_reduce raise, so
the survivors exit 1 as real training would. A worker gives up after `$BENCH_HOLD_MAX`
seconds (exit 2) so nothing can run forever; the process group's timeout is
`$BENCH_PG_TIMEOUT` seconds (60).
"""

from __future__ import annotations

import time

T0 = time.time()

import json  # noqa: E402 - the timestamp above is the first thing this script does
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402

OUT = os.environ["BENCH_DIR"]
RANK = int(os.environ.get("RANK", "-1"))
WORLD = int(os.environ.get("WORLD_SIZE", "0"))
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
EVENT = os.path.join(OUT, "event")
LATER = os.path.exists(EVENT)


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _stamp(phase: str, t: float) -> None:
    d = {"t": t, "rank": RANK, "restart": RESTART, "pid": os.getpid(), "later": LATER}
    d["world"] = WORLD
    _write(os.path.join(OUT, f"{phase}-{os.getpid()}.json"), json.dumps(d))


_stamp("start", T0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _first_attempt_steps() -> int:
    n = 0
    for name in os.listdir(OUT):
        if name.startswith("step-") and name.endswith(".json"):
            try:
                with open(os.path.join(OUT, name)) as f:
                    n += not json.load(f)["later"]
            except (OSError, ValueError, KeyError):
                continue
    return n


def _all_reduce() -> None:
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    world = dist.get_world_size()
    if int(x.item()) != world * (world + 1) // 2:
        raise RuntimeError(f"all_reduce gave {x.item()}, expected {world * (world + 1) // 2}")


def main() -> int:
    timeout = timedelta(seconds=float(os.environ.get("BENCH_PG_TIMEOUT", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    _stamp("init", time.time())
    _all_reduce()
    _stamp("step", time.time())

    mode = os.environ.get("BENCH_MODE", "ready")
    steps = int(os.environ.get("BENCH_STEPS", "5"))
    step_s = float(os.environ.get("BENCH_STEP_S", "0.1"))
    settle = float(os.environ.get("BENCH_SETTLE", "0.5"))
    crasher = mode == "crash" and not LATER and int(os.environ.get("BENCH_CRASH_RANK", "1")) == RANK
    finite = mode == "ready" or LATER
    deadline = time.monotonic() + float(os.environ.get("BENCH_HOLD_MAX", "120"))
    all_ready_at: float | None = None
    done = 1
    while not finite or done < steps:
        if time.monotonic() > deadline:
            return 2
        time.sleep(step_s)
        if crasher:
            if all_ready_at is None and _first_attempt_steps() >= WORLD:
                all_ready_at = time.monotonic()
            if all_ready_at is not None and time.monotonic() - all_ready_at >= settle:
                print(f"rank {RANK} failing on purpose", file=sys.stderr, flush=True)
                _write(EVENT, json.dumps({"t": time.time(), "rank": RANK}))
                os._exit(1)
        _all_reduce()
        done += 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
