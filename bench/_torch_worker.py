"""The torch benchmark worker: init_process_group(gloo) and one all_reduce, for gelastic and
torchrun alike.

It reads torchrun's environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`/`MASTER_PORT`,
`TORCHELASTIC_USE_AGENT_STORE`, `TORCHELASTIC_RESTART_COUNT`) and writes timestamps into
`$BENCH_DIR`, each file written to a temporary name and renamed, all `{"t", "rank", "restart",
"pid", "later"}`:

- `start-<pid>.json`: its first statement (`time.time()`).
- `torch-<pid>.json`: after `import torch` and `import torch.distributed`.
- `ready-<pid>.json`: after `init_process_group("gloo")` and one `all_reduce` of a 1-element
  tensor (its result is checked: the sum of every rank's `rank + 1`).
- `event`: the failure time, written by rank `$BENCH_CRASH_RANK` right before it fails.

`later` is whether `event` already existed when the script began: a worker of a later attempt.

What it does after its first all_reduce (`$BENCH_MODE`):

- `ready`: destroy the process group and exit 0.
- `crash`: a later attempt exits 0 as `ready` does. In the first attempt rank `$BENCH_CRASH_RANK`
  waits until all `WORLD_SIZE` workers are ready (plus `$BENCH_SETTLE` seconds, so the crash hits
  a running job), writes `event` and exits 1 (`os._exit`: a hard crash); the others sleep as if
  training, until stopped.
- `raise`: like `crash`, but the failing rank raises RuntimeError inside a function decorated
  with torch's `@record`, which writes torchelastic's error file before the exception ends the
  process.

With `$BENCH_TERM_CKPT` set, a worker of the first attempt that is still training when SIGTERM
comes saves a checkpoint in its handler, as a preemption-aware training script does: the state
(`$BENCH_TERM_CKPT` MiB of float32) goes through `torch.save` to a temporary file in `$BENCH_DIR`,
which is renamed into place, then the worker stamps `ckpt` and exits 0.

A sleeping worker gives up after `$BENCH_HOLD_MAX` seconds (exit 2) so nothing can hang forever;
the process group's timeout is `$BENCH_PG_TIMEOUT` seconds (60).
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
    _write(os.path.join(OUT, f"{phase}-{os.getpid()}.json"), json.dumps(d))


_stamp("start", T0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

_stamp("torch", time.time())


def _count_ready() -> int:
    n = 0
    for name in os.listdir(OUT):
        if name.startswith("ready-") and name.endswith(".json"):
            try:
                with open(os.path.join(OUT, name)) as f:
                    n += not json.load(f)["later"]
            except (OSError, ValueError, KeyError):
                continue
    return n


def _init_and_all_reduce() -> None:
    timeout = timedelta(seconds=float(os.environ.get("BENCH_PG_TIMEOUT", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    world = dist.get_world_size()
    if int(x.item()) != world * (world + 1) // 2:
        raise RuntimeError(f"all_reduce gave {x.item()}, expected {world * (world + 1) // 2}")
    _stamp("ready", time.time())


def _checkpoint_on_term() -> None:
    """Install the SIGTERM handler of `$BENCH_TERM_CKPT` (see the module docstring)."""
    import signal

    mib = float(os.environ["BENCH_TERM_CKPT"])
    state = {"w": torch.zeros(int(mib * 1024 * 1024 / 4))}

    def on_term(signum: int, frame: object) -> None:
        path = os.path.join(OUT, f"ckpt-{RANK}.pt")
        torch.save(state, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
        _stamp("ckpt", time.time())
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)


@record
def main() -> int:
    _init_and_all_reduce()
    mode = os.environ.get("BENCH_MODE", "ready")
    if mode == "ready" or LATER:
        dist.destroy_process_group()
        return 0
    if os.environ.get("BENCH_TERM_CKPT"):
        _checkpoint_on_term()
    hold_max = float(os.environ.get("BENCH_HOLD_MAX", "120"))
    deadline = time.monotonic() + hold_max
    if int(os.environ.get("BENCH_CRASH_RANK", "1")) == RANK:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        while _count_ready() < world:
            if time.monotonic() > deadline:
                return 2
            time.sleep(0.01)
        time.sleep(float(os.environ.get("BENCH_SETTLE", "0.5")))
        print(f"rank {RANK} failing on purpose ({mode})", file=sys.stderr, flush=True)
        _write(EVENT, json.dumps({"t": time.time(), "rank": RANK}))
        if mode == "raise":
            raise RuntimeError(f"rank {RANK} failing on purpose")
        os._exit(1)
    while time.monotonic() < deadline:
        time.sleep(0.2)
    return 2


if __name__ == "__main__":
    sys.exit(main())
