"""The drain benchmark's worker: the standard library and `client.preempted()` only.

Like `_worker.py` it writes `start-<pid>.json` at its first line (`{"t", "rank", "restart",
"pid", "later"}`) into `$BENCH_DIR`, and a worker started after the benchmark's `event` file
exists (one of the re-formed round) exits 0 at once. A worker of the first round polls
`preempted()` every 2 ms and writes `notice-<pid>.json` (`{"t"}`) when the notice appears;
with `$BENCH_MODE` `leave` it then exits 0 (it "checkpointed" and left), with `stay` it runs on
until SIGTERM. On SIGTERM it writes `term-<pid>.json` (`{"t", "notice", "had_notice"}`: when it
saw the notice, None if not yet, and whether the notice was there at SIGTERM) and exits 0. It
gives up after 120 s (exit 2).
"""

from __future__ import annotations

import time

T0 = time.time()

import json  # noqa: E402 - the timestamp above is the first thing this script does
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

from client import preempted  # noqa: E402

OUT = os.environ["BENCH_DIR"]
noticed: float | None = None


def _write(name: str, doc: dict[str, object]) -> None:
    path = os.path.join(OUT, name)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(doc))
    os.replace(tmp, path)


def _on_term(signum: int, frame: types.FrameType | None) -> None:
    t = time.time()
    had = noticed is not None or preempted() is not None
    _write(f"term-{os.getpid()}.json", {"t": t, "notice": noticed, "had_notice": had})
    sys.exit(0)


def main() -> int:
    global noticed
    later = os.path.exists(os.path.join(OUT, "event"))
    rank = int(os.environ.get("RANK", "-1"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    stamp = {"t": T0, "rank": rank, "restart": restart, "pid": os.getpid(), "later": later}
    _write(f"start-{os.getpid()}.json", stamp)
    if later:
        return 0
    signal.signal(signal.SIGTERM, _on_term)
    leave = os.environ.get("BENCH_MODE", "leave") == "leave"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if noticed is None and preempted() is not None:
            noticed = time.time()
            _write(f"notice-{os.getpid()}.json", {"t": noticed})
            if leave:
                return 0
        time.sleep(0.002)
    return 2


if __name__ == "__main__":
    sys.exit(main())
